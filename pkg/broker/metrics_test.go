package broker

import (
	"context"
	"errors"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	authenticationv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	authenticationv1client "k8s.io/client-go/kubernetes/typed/authentication/v1"
)

type fakeTokenReviews struct {
	authenticationv1client.TokenReviewInterface
	err error
}

func (f fakeTokenReviews) Create(context.Context, *authenticationv1.TokenReview, metav1.CreateOptions) (*authenticationv1.TokenReview, error) {
	return &authenticationv1.TokenReview{}, f.err
}

// Hub review errors count the hub's failures, not the callers that gave up.
func TestHubReviewMetrics(t *testing.T) {
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	tests := []struct {
		name       string
		ctx        context.Context
		err        error
		wantErrors float64
	}{
		{"answered", context.Background(), nil, 0},
		{"hub failed", context.Background(), errors.New("connection refused"), 1},
		{"caller gave up", canceled, context.Canceled, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := &hubReviewMetrics{
				duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "d"}, []string{"kind"}),
				errors:   prometheus.NewCounterVec(prometheus.CounterOpts{Name: "e"}, []string{"kind"}),
			}
			_, err := timedTokenReviews{fakeTokenReviews{err: tt.err}, m}.Create(tt.ctx, &authenticationv1.TokenReview{}, metav1.CreateOptions{})
			assert.Equal(t, tt.err, err)
			assert.Equal(t, 1, testutil.CollectAndCount(m.duration), "one latency observed")
			assert.Equal(t, tt.wantErrors, testutil.ToFloat64(m.errors.WithLabelValues(kindTokenReview)))
		})
	}
}
