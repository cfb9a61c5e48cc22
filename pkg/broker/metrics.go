package broker

import (
	"context"
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	authenticationv1client "k8s.io/client-go/kubernetes/typed/authentication/v1"
	authorizationv1client "k8s.io/client-go/kubernetes/typed/authorization/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/credbroker/credbroker/internal/metrics"
	"github.com/credbroker/credbroker/pkg/identity"
)

// The review kinds, the label values of the hub review metrics.
const (
	kindTokenReview         = "TokenReview"
	kindSubjectAccessReview = "SubjectAccessReview"
)

// hubReviewMetrics time the broker's TokenReviews and SubjectAccessReviews on
// the hub: those of exchanges, of the Grants API and of the revocation
// triggers.
type hubReviewMetrics struct {
	duration *prometheus.HistogramVec
	errors   *prometheus.CounterVec
}

// newRegistry returns the broker's per-process registry with the process
// and Go collectors and the metrics that belong to no service: the build,
// the SVID's expiry, the ClusterProfiles known and the hub reviews. The
// services (tunnel, tokenexchange, hubkeys) register theirs in it
// through their Config.Registerer.
func newRegistry(svid identity.Source, profiles cache.SharedIndexInformer) (*prometheus.Registry, *hubReviewMetrics, error) {
	reg := prometheus.NewRegistry()
	m := &hubReviewMetrics{
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "credbroker",
			Name:      "hub_review_duration_seconds",
			Help:      "Latency of the broker's TokenReviews and SubjectAccessReviews on the hub, by kind, failed ones included.",
			Buckets:   prometheus.ExponentialBuckets(0.001, 2, 14),
		}, []string{"kind"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "credbroker",
			Name:      "hub_review_errors_total",
			Help:      "TokenReviews and SubjectAccessReviews the hub did not answer (an error, not a denial), by kind.",
		}, []string{"kind"}),
	}
	for _, k := range []string{kindTokenReview, kindSubjectAccessReview} {
		m.duration.WithLabelValues(k)
		m.errors.WithLabelValues(k)
	}
	err := metrics.Register(reg,
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		metrics.BuildInfo("credbroker_build_info", "The broker's build: version, VCS revision and Go version; always 1."),
		metrics.SVIDExpiry("credbroker_svid_expiry_timestamp_seconds",
			"NotAfter of the broker's current X.509-SVID, in seconds since the epoch; 0 when it has none.", svid),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Namespace: "credbroker",
			Name:      "cluster_profiles",
			Help:      "ClusterProfiles in the broker's cache: each expects an agent stream to every broker replica.",
		}, func() float64 { return float64(len(profiles.GetStore().ListKeys())) }),
		m.duration, m.errors,
	)
	if err != nil {
		return nil, nil, err
	}
	return reg, m, nil
}

// timed calls create and records its duration and failure as one review
// of kind.
func timed[T any](ctx context.Context, m *hubReviewMetrics, kind string, create func() (T, error)) (T, error) {
	start := time.Now()
	out, err := create()
	m.duration.WithLabelValues(kind).Observe(time.Since(start).Seconds())
	// A caller that gave up is not the hub's failure.
	if err != nil && !(errors.Is(err, context.Canceled) && ctx.Err() != nil) {
		m.errors.WithLabelValues(kind).Inc()
	}
	return out, err
}

// timedTokenReviews times the TokenReviews of its client.
type timedTokenReviews struct {
	authenticationv1client.TokenReviewInterface
	m *hubReviewMetrics
}

func (t timedTokenReviews) Create(ctx context.Context, r *authenticationv1.TokenReview, opts metav1.CreateOptions) (*authenticationv1.TokenReview, error) {
	return timed(ctx, t.m, kindTokenReview, func() (*authenticationv1.TokenReview, error) { return t.TokenReviewInterface.Create(ctx, r, opts) })
}

// timedAccessReviews times the SubjectAccessReviews of its client.
type timedAccessReviews struct {
	authorizationv1client.SubjectAccessReviewInterface
	m *hubReviewMetrics
}

func (t timedAccessReviews) Create(ctx context.Context, r *authorizationv1.SubjectAccessReview, opts metav1.CreateOptions) (*authorizationv1.SubjectAccessReview, error) {
	return timed(ctx, t.m, kindSubjectAccessReview, func() (*authorizationv1.SubjectAccessReview, error) {
		return t.SubjectAccessReviewInterface.Create(ctx, r, opts)
	})
}
