package agent

import (
	"context"
	"errors"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/internal/probe"
	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/tunnel"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

var (
	streamsServing = prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: "credbroker",
		Name:      "agent_broker_streams",
		Help:      "Broker streams of this agent that serve: admitted, and neither draining nor leaving.",
	})
	mintDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: "credbroker",
		Name:      "agent_token_request_duration_seconds",
		Help:      "Time the agent took to answer a broker's mint request (policy, grant, TokenRequest), by gRPC code.",
		Buckets:   prometheus.ExponentialBuckets(0.005, 2, 12),
	}, []string{"code"})
)

// Collectors returns the agent's metrics, for the caller to register.
func Collectors() []prometheus.Collector {
	return []prometheus.Collector{streamsServing, mintDuration}
}

// countServing is the tunnel clients' Serving callback.
func (a *Agent) countServing(up bool) {
	if up {
		a.serving.Add(1)
		streamsServing.Inc()
	} else {
		a.serving.Add(-1)
		streamsServing.Dec()
	}
}

// Ready reports nil while the agent can serve, or why not: at least one
// broker stream serves (admitted, neither draining nor leaving), and its
// SVID is valid. /readyz answers it.
func (a *Agent) Ready() error {
	return a.ready(clock.RealClock{})
}

func (a *Agent) ready(clk clock.PassiveClock) error {
	return probe.All(
		probe.SVIDValid(a.svid, clk, 0),
		func() error {
			if a.serving.Load() <= 0 {
				return errors.New("no broker stream serves")
			}
			return nil
		},
	)()
}

// serveMetrics serves /metrics, /healthz and /readyz on the metrics
// listener, and returns the func that stops it.
func (a *Agent) serveMetrics() (stop func()) {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(a.registry, promhttp.HandlerOpts{}))
	probe.Serve(mux, probe.All(), a.Ready)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(a.metricsLis); err != nil && !errors.Is(err, http.ErrServerClosed) {
			a.cfg.Log.Error(err, "metrics server stopped")
		}
	}()
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
		<-done
	}
}

// MetricsAddr is the bound address of the metrics listener; empty when it
// is disabled.
func (a *Agent) MetricsAddr() string {
	if a.metricsLis == nil {
		return ""
	}
	return a.metricsLis.Addr().String()
}

// instrumented times the agent's mints.
type instrumented struct{ m tunnel.Minter }

func (i instrumented) Mint(ctx context.Context, req *pb.MintRequest) (*pb.MintResponse, error) {
	start := time.Now()
	resp, err := i.m.Mint(ctx, req)
	mintDuration.WithLabelValues(errdefs.Code(err).String()).Observe(time.Since(start).Seconds())
	return resp, err
}
