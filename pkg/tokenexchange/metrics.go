package tokenexchange

import "github.com/prometheus/client_golang/prometheus"

var (
	exchanges = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "credbroker",
		Name:      "exchanges_total",
		Help:      "Token exchanges by gRPC code and token cache result (hit or miss).",
	}, []string{"code", "cache"})
	exchangeDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: "credbroker",
		Name:      "exchange_duration_seconds",
		Help:      "Latency of token exchanges by gRPC code.",
		Buckets:   prometheus.ExponentialBuckets(0.0005, 2, 16),
	}, []string{"code"})
	cacheLookups = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "credbroker",
		Name:      "decision_cache_lookups_total",
		Help:      "TokenReview (authn) and SubjectAccessReview (authz) cache lookups by result (hit or miss).",
	}, []string{"cache", "result"})
)

// Collectors returns the package's metrics, for the caller to register.
func Collectors() []prometheus.Collector {
	return []prometheus.Collector{exchanges, exchangeDuration, cacheLookups}
}

func cacheLabel(hit bool) string {
	if hit {
		return "hit"
	}
	return "miss"
}
