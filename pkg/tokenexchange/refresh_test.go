package tokenexchange

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A consumer that keeps calling has its decisions refreshed before they
// end, so its calls never meet the review limit of its address, which
// other pods behind that address spent. Before: when its TokenReview
// ended, its next call was a new review, refused with ResourceExhausted.
func TestDecisionsOfAKnownConsumerAreRefreshedAhead(t *testing.T) {
	f := newFixture(t, func(c *Config) { c.PeerReviewRateLimit, c.PeerReviewBurst = 0.001, 2 })
	node := fromPeer(withBearer, "10.0.0.1:1000")
	_, err := f.svc.Exchange(node(consumerToken), fleetA())
	require.NoError(t, err)
	require.Equal(t, []int32{1, 1}, []int32{f.reviews.tokenReviews.Load(), f.reviews.accessReviews.Load()})

	// A neighbour behind the same address spends the rest of its budget.
	_, err = f.svc.Exchange(node(jwt(`{"sub":"neighbour"}`)), fleetA())
	require.Equal(t, codes.Unauthenticated, status.Code(err))
	_, err = f.svc.Exchange(node(jwt(`{"sub":"neighbour-2"}`)), fleetA())
	require.Equal(t, codes.ResourceExhausted, status.Code(err))

	// The last quarter of the decisions' 10s: a call is served from the
	// cache and refreshes them in the background.
	f.clock.Step(8 * time.Second)
	_, err = f.svc.Exchange(node(consumerToken), fleetA())
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		return f.reviews.tokenReviews.Load() == 3 && f.reviews.accessReviews.Load() == 2
	}, 10*time.Second, time.Millisecond, "the TokenReview and the SubjectAccessReview are refreshed")

	// Past the first decisions' end, the refreshed ones serve.
	f.clock.Step(5 * time.Second)
	for range 5 {
		_, err = f.svc.Exchange(node(consumerToken), fleetA())
		require.NoError(t, err)
	}
	assert.Equal(t, int32(3), f.reviews.tokenReviews.Load())
	assert.Equal(t, int32(2), f.reviews.accessReviews.Load())
}

// Refreshes are paced by the broker-wide and per-consumer limits: they
// wait for budget rather than being refused, and a denial or a token near
// its end is not refreshed.
func TestRefreshesWaitForBudgetAndSkipWhatWillNotLast(t *testing.T) {
	f := newFixture(t, func(c *Config) { c.ReviewRateLimit, c.ReviewBurst = 50, 1 })
	_, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
	require.NoError(t, err)
	f.clock.Step(8 * time.Second)
	// The broker-wide budget is spent now: the refresh waits for it (20ms
	// of real time at 50/s) instead of failing.
	for i := range 3 {
		_, _ = f.svc.Exchange(withBearer(jwt(fmt.Sprintf(`{"sub":"other-%d"}`, i))), fleetA())
	}
	_, err = f.svc.Exchange(withBearer(consumerToken), fleetA())
	require.NoError(t, err)
	require.Eventually(t, func() bool { return f.reviews.tokenReviews.Load() == 3 }, 10*time.Second, time.Millisecond,
		"the refresh waited for the broker's budget")

	// A token that ends within the refresh window is not refreshed.
	f2 := newFixture(t)
	expiring := consumerTokenExpiring(t0.Add(10 * time.Second))
	_, err = f2.svc.Exchange(withBearer(expiring), fleetA())
	require.NoError(t, err)
	f2.clock.Step(8 * time.Second)
	_, err = f2.svc.Exchange(withBearer(expiring), fleetA())
	require.NoError(t, err)
	time.Sleep(50 * time.Millisecond) // a refresh, if one started, would have reviewed by now
	assert.Equal(t, int32(1), f2.reviews.tokenReviews.Load())
}
