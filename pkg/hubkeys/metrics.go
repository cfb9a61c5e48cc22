package hubkeys

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	promreg "github.com/credbroker/credbroker/internal/metrics"
)

// The reasons Verify refuses a token, the label values of
// credbroker_hub_token_rejections_total.
const (
	reasonMalformed   = "malformed"
	reasonAlgorithm   = "algorithm"
	reasonUnknownKey  = "unknown_key"
	reasonSignature   = "signature"
	reasonExpired     = "expired"
	reasonNotYetValid = "not_yet_valid"
	reasonAudience    = "audience"
)

// metrics are one Keys' own; each Keys registers them, so that two in one
// process count apart.
type metrics struct {
	rejections *prometheus.CounterVec
	fetches    *prometheus.CounterVec
}

// newMetrics registers the metrics in reg, or in a private registry when reg
// is nil (counted, exposed nowhere).
func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		rejections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "credbroker",
			Name:      "hub_token_rejections_total",
			Help:      "Bearer tokens refused by local verification against the hub issuer's keys, before any TokenReview, by reason.",
		}, []string{"reason"}),
		fetches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "credbroker",
			Name:      "hub_keys_fetches_total",
			Help:      "Fetches of the hub issuer's key set by result (changed, unchanged or error).",
		}, []string{"result"}),
	}
	for _, r := range []string{reasonMalformed, reasonAlgorithm, reasonUnknownKey, reasonSignature, reasonExpired, reasonNotYetValid, reasonAudience} {
		m.rejections.WithLabelValues(r)
	}
	for _, r := range []string{"changed", "unchanged", "error"} {
		m.fetches.WithLabelValues(r)
	}
	if err := promreg.Register(reg, m.rejections, m.fetches); err != nil {
		return nil, fmt.Errorf("hubkeys: %w", err)
	}
	return m, nil
}
