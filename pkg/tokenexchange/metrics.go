package tokenexchange

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"

	promreg "github.com/credbroker/credbroker/internal/metrics"
)

// metrics are one Service's; each Service registers its own, so that two
// in one process (as in the e2e tests) count apart.
type metrics struct {
	exchanges        *prometheus.CounterVec
	exchangeDuration *prometheus.HistogramVec
	cacheLookups     *prometheus.CounterVec

	// The series that every answered exchange counts, looked up once
	// rather than by label values on every call: exchanges and their
	// latency with code OK, by token cache miss (0) and hit (1), and the
	// lookups of each decision cache by miss and hit.
	answered   [2]prometheus.Counter
	answeredIn prometheus.Observer
	lookups    [decisionCaches][2]prometheus.Counter
}

// decisionCache names a cache of hub decisions in cacheLookups.
type decisionCache int

const (
	authnCache decisionCache = iota // TokenReviews
	authzCache                      // SubjectAccessReviews
	decisionCaches
)

var decisionCacheLabels = [decisionCaches]string{authnCache: "authn", authzCache: "authz"}

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
	ok := codes.OK.String()
	for _, hit := range []bool{false, true} {
		m.answered[hitIndex(hit)] = m.exchanges.WithLabelValues(ok, cacheLabel(hit))
		for c, label := range decisionCacheLabels {
			m.lookups[c][hitIndex(hit)] = m.cacheLookups.WithLabelValues(label, cacheLabel(hit))
		}
	}
	m.answeredIn = m.exchangeDuration.WithLabelValues(ok)
	return m, nil
}

// exchanged counts an exchange that ended with code after latency, and
// whether its token came from the cache.
func (m *metrics) exchanged(code codes.Code, hit bool, latency time.Duration) {
	if code == codes.OK {
		m.answered[hitIndex(hit)].Inc()
		m.answeredIn.Observe(latency.Seconds())
		return
	}
	m.exchanges.WithLabelValues(code.String(), cacheLabel(hit)).Inc()
	m.exchangeDuration.WithLabelValues(code.String()).Observe(latency.Seconds())
}

// lookedUp counts a lookup of the decision cache c.
func (m *metrics) lookedUp(c decisionCache, hit bool) {
	m.lookups[c][hitIndex(hit)].Inc()
}

func hitIndex(hit bool) int {
	if hit {
		return 1
	}
	return 0
}

func cacheLabel(hit bool) string {
	if hit {
		return "hit"
	}
	return "miss"
}
