package tunnel

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/credbroker/credbroker/pkg/errdefs"
)

var (
	streamsGauge = prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: "credbroker",
		Name:      "agent_streams",
		Help:      "Agent streams connected to this broker.",
	})
	mintDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: "credbroker",
		Name:      "agent_mint_duration_seconds",
		Help:      "Time from sending a mint request down an agent stream to its answer, by gRPC code.",
		Buckets:   prometheus.ExponentialBuckets(0.005, 2, 12),
	}, []string{"code"})
	revokes = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "credbroker",
		Name:      "agent_revokes_total",
		Help:      "Revoke requests sent down agent streams, by the gRPC code of their outcome.",
	}, []string{"code"})
)

// Collectors returns the package's metrics, for the caller to register.
func Collectors() []prometheus.Collector {
	return []prometheus.Collector{streamsGauge, mintDuration, revokes}
}

func observeMint(start time.Time, err error) {
	mintDuration.WithLabelValues(errdefs.Code(err).String()).Observe(time.Since(start).Seconds())
}

func observeRevoke(_ time.Time, err error) {
	revokes.WithLabelValues(errdefs.Code(err).String()).Inc()
}
