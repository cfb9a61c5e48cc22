package tunnel

import (
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/credbroker/credbroker/pkg/errdefs"

	promreg "github.com/credbroker/credbroker/internal/metrics"
)

// metrics are one Server's own; each Server registers them, so that two in
// one process (as in the e2e tests) count apart.
type metrics struct {
	streams      prometheus.Gauge
	mintDuration *prometheus.HistogramVec
	revokes      *prometheus.CounterVec
}

// newMetrics registers s's metrics in reg, or in a private registry when reg
// is nil (counted, exposed nowhere).
func newMetrics(reg prometheus.Registerer, s *Server) (*metrics, error) {
	m := &metrics{
		streams: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "credbroker",
			Name:      "agent_streams",
			Help:      "Agent streams connected to this broker.",
		}),
		mintDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "credbroker",
			Name:      "agent_mint_duration_seconds",
			Help:      "Time from sending a mint request down an agent stream to its answer, by gRPC code.",
			Buckets:   prometheus.ExponentialBuckets(0.005, 2, 12),
		}, []string{"code"}),
		revokes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "credbroker",
			Name:      "agent_revokes_total",
			Help:      "Revoke requests sent down agent streams, by the gRPC code of their outcome.",
		}, []string{"code"}),
	}
	// One series whatever the fleet's size: which ClusterProfile has no
	// agent is in its status (package publish) and in the broker's log.
	connected := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: "credbroker",
		Name:      "connected_clusters",
		Help:      "ClusterProfiles with at least one live agent stream to this broker.",
	}, func() float64 { return float64(s.ConnectedClusters()) })
	pending := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: "credbroker",
		Name:      "agent_requests_pending",
		Help:      "Mints and revokes sent to agents and not answered yet; back to 0 once a fault has passed.",
	}, func() float64 { return float64(s.Pending()) })
	if err := promreg.Register(reg, m.streams, m.mintDuration, m.revokes, connected, pending); err != nil {
		return nil, fmt.Errorf("tunnel: %w", err)
	}
	return m, nil
}

func (m *metrics) observeMint(start time.Time, err error) {
	m.mintDuration.WithLabelValues(errdefs.Code(err).String()).Observe(time.Since(start).Seconds())
}

func (m *metrics) observeRevoke(_ time.Time, err error) {
	m.revokes.WithLabelValues(errdefs.Code(err).String()).Inc()
}
