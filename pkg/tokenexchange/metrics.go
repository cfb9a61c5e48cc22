package tokenexchange

import (
	"github.com/prometheus/client_golang/prometheus"

	promreg "github.com/credbroker/credbroker/internal/metrics"
)

// metrics are one Service's; each Service registers its own, so that two
// in one process (as in the e2e tests) count apart.
type metrics struct {
	exchanges        *prometheus.CounterVec
	exchangeDuration *prometheus.HistogramVec
	cacheLookups     *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		exchanges: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "credbroker",
			Name:      "exchanges_total",
			Help:      "Token exchanges by gRPC code and token cache result (hit or miss).",
		}, []string{"code", "cache"}),
		exchangeDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "credbroker",
			Name:      "exchange_duration_seconds",
			Help:      "Latency of token exchanges by gRPC code.",
			Buckets:   prometheus.ExponentialBuckets(0.0005, 2, 16),
		}, []string{"code"}),
		cacheLookups: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "credbroker",
			Name:      "decision_cache_lookups_total",
			Help:      "TokenReview (authn) and SubjectAccessReview (authz) cache lookups by result (hit or miss).",
		}, []string{"cache", "result"}),
	}
	if err := promreg.Register(reg, m.exchanges, m.exchangeDuration, m.cacheLookups); err != nil {
		return nil, err
	}
	return m, nil
}

func cacheLabel(hit bool) string {
	if hit {
		return "hit"
	}
	return "miss"
}
