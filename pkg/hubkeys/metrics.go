package hubkeys

import "github.com/prometheus/client_golang/prometheus"

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

var (
	rejections = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "credbroker",
		Name:      "hub_token_rejections_total",
		Help:      "Bearer tokens refused by local verification against the hub issuer's keys, before any TokenReview, by reason.",
	}, []string{"reason"})
	fetches = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "credbroker",
		Name:      "hub_keys_fetches_total",
		Help:      "Fetches of the hub issuer's key set by result (changed, unchanged or error).",
	}, []string{"result"})
)

func init() {
	for _, r := range []string{reasonMalformed, reasonAlgorithm, reasonUnknownKey, reasonSignature, reasonExpired, reasonNotYetValid, reasonAudience} {
		rejections.WithLabelValues(r)
	}
	for _, r := range []string{"changed", "unchanged", "error"} {
		fetches.WithLabelValues(r)
	}
}

// Collectors returns the package's metrics, for the caller to register.
func Collectors() []prometheus.Collector {
	return []prometheus.Collector{rejections, fetches}
}
