package tokenexchange

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/credbroker/credbroker/pkg/errdefs"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// fakeStream is the server side of one gRPC call, as far as Exchange uses
// it: it keeps the trailer the handler sets.
type fakeStream struct {
	mu      sync.Mutex
	trailer metadata.MD
}

func (s *fakeStream) Method() string               { return pb.TokenExchange_Exchange_FullMethodName }
func (s *fakeStream) SetHeader(metadata.MD) error  { return nil }
func (s *fakeStream) SendHeader(metadata.MD) error { return nil }
func (s *fakeStream) SetTrailer(md metadata.MD) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.trailer = metadata.Join(s.trailer, md)
	return nil
}

// call runs one Exchange as a gRPC server would, and returns its trailer.
func call(f *fixture, tok string, req *pb.ExchangeRequest) (metadata.MD, error) {
	stream := &fakeStream{}
	ctx := grpc.NewContextWithServerTransportStream(withBearer(tok), stream)
	_, err := f.svc.Exchange(ctx, req)
	return stream.trailer, err
}

// audienceReq asks for a token for fleet/a with audience aud, so that each
// aud is its own entry in the token cache.
func audienceReq(aud string) *pb.ExchangeRequest {
	return &pb.ExchangeRequest{Cluster: fleetA().Cluster, Audiences: []string{aud}}
}

// A controller that starts with many clusters asks for the same tokens
// again and again; answers from the cache cost the hub and the spokes
// nothing, so they are never refused.
func TestCachedAnswersAreNotRateLimited(t *testing.T) {
	f := newFixture(t, func(c *Config) { c.RateLimit, c.RateBurst = 1, 3 })
	for i := range 200 {
		trailer, err := call(f, consumerToken, fleetA())
		require.NoError(t, err, "exchange %d", i)
		assert.Empty(t, trailer.Get("retry-after"))
	}
	assert.Equal(t, int32(1), f.minter.calls.Load())
	assert.Equal(t, int32(1), f.reviews.tokenReviews.Load())
	assert.Equal(t, int32(1), f.reviews.accessReviews.Load())
}

// A consumer that asks for more new tokens than its burst is refused
// before its mints reach an agent, and told how long to wait.
func TestMintsBeyondTheBurstAreRefusedWithRetryAfter(t *testing.T) {
	// The first exchange costs a TokenReview, a SubjectAccessReview and a
	// mint: 3 of the burst of 5. Two more mints fit.
	f := newFixture(t, func(c *Config) { c.RateLimit, c.RateBurst = 0.5, 5 })
	for i := range 3 {
		_, err := call(f, consumerToken, audienceReq(fmt.Sprintf("aud-%d", i)))
		require.NoError(t, err, "mint %d", i)
	}
	require.Equal(t, int32(3), f.minter.calls.Load())

	trailer, err := call(f, consumerToken, audienceReq("aud-3"))
	st := status.Convert(err)
	require.Equal(t, codes.ResourceExhausted, st.Code(), st.Message())
	assert.Equal(t, int32(3), f.minter.calls.Load(), "a refused mint must not reach the agent")
	// At 0.5/s the next token is 2s away.
	assert.Equal(t, []string{"2"}, trailer.Get("retry-after"))
	assert.Contains(t, st.Message(), "retry after 2s")
	assert.Contains(t, st.Message(), "system:serviceaccount:hub:consumer")

	// The tokens minted already are still served.
	_, err = call(f, consumerToken, audienceReq("aud-0"))
	require.NoError(t, err)

	// A refusal does not spend the budget: after the wait, the mint goes.
	f.clock.Step(2 * time.Second)
	_, err = call(f, consumerToken, audienceReq("aud-3"))
	require.NoError(t, err)
	assert.Equal(t, int32(4), f.minter.calls.Load())
}

// Hub reviews cost the hub, so a consumer's TokenReviews (of tokens not in
// the authentication cache) and SubjectAccessReviews (of decisions not in
// the authorization cache) count against its limit too.
func TestHubReviewsCountAgainstTheConsumer(t *testing.T) {
	tests := []struct {
		name string
		// next makes the second exchange, whose token is in the token
		// cache, need one review.
		next        func(f *fixture) (metadata.MD, error)
		wantReviews func(f *fixture) int32
	}{
		{
			name: "TokenReview of a new hub token",
			next: func(f *fixture) (metadata.MD, error) {
				return call(f, consumerTokenExpiring(t0.Add(2*time.Hour)), fleetA())
			},
			wantReviews: func(f *fixture) int32 { return f.reviews.tokenReviews.Load() },
		},
		{
			name: "SubjectAccessReview of an expired decision",
			next: func(f *fixture) (metadata.MD, error) {
				f.clock.Step(11 * time.Second) // past AllowTTL, not AuthnTTL
				return call(f, consumerToken, fleetA())
			},
			wantReviews: func(f *fixture) int32 { return f.reviews.accessReviews.Load() },
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFixture(t, func(c *Config) {
				c.RateLimit, c.RateBurst = 0.01, 3
				c.AuthnTTL = 30 * time.Minute
			})
			_, err := call(f, consumerToken, fleetA())
			require.NoError(t, err)
			require.Equal(t, int32(1), tt.wantReviews(f))

			trailer, err := tt.next(f)
			st := status.Convert(err)
			require.Equal(t, codes.ResourceExhausted, st.Code(), st.Message())
			assert.NotEmpty(t, trailer.Get("retry-after"))
			assert.Equal(t, int32(1), f.minter.calls.Load())
		})
	}
}

// Authenticate, for the other services of the exchange port, still counts
// every call.
func TestAuthenticateCountsEveryCall(t *testing.T) {
	f := newFixture(t, func(c *Config) { c.RateLimit, c.RateBurst = 1, 2 })
	for range 2 {
		_, err := f.svc.Authenticate(withBearer(consumerToken))
		require.NoError(t, err)
	}
	_, err := f.svc.Authenticate(context.Background())
	require.Error(t, err)
	_, err = f.svc.Authenticate(withBearer(consumerToken))
	assert.ErrorIs(t, err, errdefs.ErrResourceExhausted)
}
