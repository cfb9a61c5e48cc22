package agent

import (
	"context"
	"errors"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	authenticationv1 "k8s.io/api/authentication/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"github.com/credbroker/credbroker/internal/metrics"
	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/identity"
	"github.com/credbroker/credbroker/pkg/spoke"
	"github.com/credbroker/credbroker/pkg/tunnel"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// agentMetrics are one Agent's, in its per-process registry.
type agentMetrics struct {
	// streams counts the broker streams that serve; targetStreams the same
	// per configured broker target, and targetAddresses the addresses
	// (broker replicas) each target resolves to. The targets are the
	// agent's flags, so their cardinality is the operator's.
	streams         prometheus.Gauge
	targetStreams   *prometheus.GaugeVec
	targetAddresses *prometheus.GaugeVec
	mintDuration    *prometheus.HistogramVec
	tokenRequests   *prometheus.CounterVec
	spokeReady      prometheus.Gauge
}

// newAgentRegistry returns the agent's per-process registry and its metrics.
func newAgentRegistry(svid identity.Source, targets []string) (*prometheus.Registry, *agentMetrics, error) {
	m := &agentMetrics{
		streams: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "credbroker",
			Name:      "agent_broker_streams",
			Help:      "Broker streams of this agent that serve: admitted, and neither draining nor leaving.",
		}),
		targetStreams: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: "credbroker",
			Name:      "agent_broker_target_streams",
			Help:      "Broker streams of this agent that serve, by broker target (--broker-address).",
		}, []string{"target"}),
		targetAddresses: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: "credbroker",
			Name:      "agent_broker_target_addresses",
			Help:      "Addresses (broker replicas) each broker target resolves to, each of which should have a serving stream.",
		}, []string{"target"}),
		mintDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "credbroker",
			Name:      "agent_token_request_duration_seconds",
			Help:      "Time the agent took to answer a broker's mint request (policy, grant, TokenRequest), by gRPC code.",
			Buckets:   prometheus.ExponentialBuckets(0.005, 2, 12),
		}, []string{"code"}),
		tokenRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "credbroker",
			Name:      "agent_token_requests_total",
			Help:      "TokenRequest calls to the spoke API server, by its HTTP status code (201, 403, …), or \"error\" when none came back.",
		}, []string{"code"}),
		spokeReady: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "credbroker",
			Name:      "agent_spoke_ready",
			Help:      "1 while the spoke API server's /readyz answers, 0 once it has failed --spoke-health-failure-threshold times in a row (and until it answers again); 0 also before the first probe and when probes are off.",
		}),
	}
	for _, t := range targets {
		m.targetStreams.WithLabelValues(t)
		m.targetAddresses.WithLabelValues(t)
	}
	m.tokenRequests.WithLabelValues("201")
	reg := prometheus.NewRegistry()
	err := metrics.Register(reg,
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		metrics.BuildInfo("credbroker_agent_build_info", "The agent's build: version, VCS revision and Go version; always 1."),
		metrics.SVIDExpiry("credbroker_agent_svid_expiry_timestamp_seconds",
			"NotAfter of the agent's current X.509-SVID, in seconds since the epoch; 0 when it has none.", svid),
		m.streams, m.targetStreams, m.targetAddresses, m.mintDuration, m.tokenRequests, m.spokeReady,
	)
	if err != nil {
		return nil, nil, err
	}
	return reg, m, nil
}

// instrumented times the agent's mints.
type instrumented struct {
	m       tunnel.Minter
	metrics *agentMetrics
}

func (i instrumented) Mint(ctx context.Context, cluster fleet.ClusterRef, req *pb.MintRequest) (*pb.MintResponse, error) {
	start := time.Now()
	resp, err := i.m.Mint(ctx, cluster, req)
	i.metrics.mintDuration.WithLabelValues(errdefs.Code(err).String()).Observe(time.Since(start).Seconds())
	return resp, err
}

// countedTokens counts the TokenRequests by the spoke API server's answer.
type countedTokens struct {
	spoke.TokenCreator
	metrics *agentMetrics
}

func (c countedTokens) CreateToken(ctx context.Context, namespace, name string, req *authenticationv1.TokenRequest) (*authenticationv1.TokenRequest, error) {
	out, err := c.TokenCreator.CreateToken(ctx, namespace, name, req)
	c.metrics.tokenRequests.WithLabelValues(statusCode(err)).Inc()
	return out, err
}

// statusCode is the HTTP status of a client-go call's outcome: 201 for a
// created object, the API server's code for its refusals, and "error" when
// no status came back (a timeout, a connection refused).
func statusCode(err error) string {
	if err == nil {
		return "201"
	}
	var status apierrors.APIStatus
	if errors.As(err, &status) {
		if code := status.Status().Code; code != 0 {
			return strconv.Itoa(int(code))
		}
	}
	return "error"
}
