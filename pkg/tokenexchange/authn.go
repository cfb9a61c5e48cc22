package tokenexchange

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	authenticationv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/hubauth"
	"github.com/credbroker/credbroker/pkg/token"
)

// userInfo is the hub identity a TokenReview returned.
type userInfo = hubauth.User

// authnResult is a cached TokenReview outcome: a user, or why there is none.
type authnResult struct {
	user   userInfo
	reason string
}

// bearerToken reads the "authorization: Bearer <token>" metadata and checks
// that the token has the shape of a JWT.
func bearerToken(ctx context.Context) (string, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	values := md.Get("authorization")
	if len(values) != 1 {
		return "", fmt.Errorf("send one 'authorization: Bearer <hub ServiceAccount token>' header, got %d: %w", len(values), errdefs.ErrUnauthenticated)
	}
	scheme, tok, ok := strings.Cut(values[0], " ")
	if !ok || !strings.EqualFold(scheme, "bearer") {
		return "", fmt.Errorf("the authorization header must use the Bearer scheme: %w", errdefs.ErrUnauthenticated)
	}
	if err := token.CheckShape(tok); err != nil {
		return "", fmt.Errorf("%w: %w", err, errdefs.ErrUnauthenticated)
	}
	return tok, nil
}

// authenticate checks bearer with a hub TokenReview for the broker's
// audience. Results are cached under an HMAC of the token: successes for
// AuthnTTL but never past the token's exp claim as the Verifier verified
// it, failures for DenyTTL.
// Before its review, a token not in the cache must pass the Verifier and
// the review limits of its peer address and of the broker.
func (s *Service) authenticate(ctx context.Context, bearer string) (userInfo, error) {
	user, _, err := s.authenticateReviewed(ctx, bearer)
	return user, err
}

// authenticateReviewed is authenticate, and also reports whether this call
// sent the TokenReview (the token was not in the cache, and no concurrent
// call was reviewing it already).
func (s *Service) authenticateReviewed(ctx context.Context, bearer string) (userInfo, bool, error) {
	mac := hmac.New(sha256.New, s.cfg.HMACKey)
	mac.Write([]byte(bearer))
	key := hex.EncodeToString(mac.Sum(nil))

	var reviewed atomic.Bool
	res, hit, err := s.authn.Do(ctx, key, func(ctx context.Context) (authnResult, time.Time, error) {
		return s.tokenReview(ctx, bearer, &reviewed)
	})
	s.metrics.cacheLookups.WithLabelValues("authn", cacheLabel(hit)).Inc()
	if err != nil {
		return userInfo{}, false, err
	}
	if res.reason != "" {
		return userInfo{}, false, fmt.Errorf("the hub rejected the token for audience %q: %s: %w", s.cfg.Audience, res.reason, errdefs.ErrUnauthenticated)
	}
	return res.user, reviewed.Load(), nil
}

// tokenReview sets reviewed once it has sent the review to the hub.
func (s *Service) tokenReview(ctx context.Context, bearer string, reviewed *atomic.Bool) (authnResult, time.Time, error) {
	// Forged, expired and wrong-audience tokens end here, costing no hub
	// call and no review budget. Their refusal is not cached: checking
	// again is cheaper than the cache entry.
	exp, err := s.cfg.Verifier.Verify(ctx, bearer)
	if err != nil {
		return authnResult{}, time.Time{}, err
	}
	now := s.cfg.Clock.Now()
	addr := peerAddress(ctx)
	lim, _, err := s.peerReviews.Do(ctx, addr, func(context.Context) (*rate.Limiter, time.Time, error) {
		return rate.NewLimiter(s.cfg.PeerReviewRateLimit, s.cfg.PeerReviewBurst), now.Add(time.Hour), nil
	})
	if err != nil {
		return authnResult{}, time.Time{}, err
	}
	if !lim.AllowN(now, 1) {
		return authnResult{}, time.Time{}, fmt.Errorf("your address sent more than %v new tokens per second for review; retry shortly: %w",
			s.cfg.PeerReviewRateLimit, errdefs.ErrResourceExhausted)
	}
	if !s.reviews.AllowN(now, 1) {
		return authnResult{}, time.Time{}, fmt.Errorf("the broker is reviewing more than %v new tokens per second; retry shortly: %w",
			s.cfg.ReviewRateLimit, errdefs.ErrResourceExhausted)
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ReviewTimeout)
	defer cancel()
	reviewed.Store(true)
	review, err := s.cfg.TokenReviews.Create(ctx, &authenticationv1.TokenReview{
		Spec: authenticationv1.TokenReviewSpec{Token: bearer, Audiences: []string{s.cfg.Audience}},
	}, metav1.CreateOptions{})
	if err != nil {
		return authnResult{}, time.Time{}, s.hubFailure("TokenReview", err)
	}
	st := review.Status
	switch {
	case !st.Authenticated:
		reason := st.Error
		if reason == "" {
			reason = "not authenticated"
		}
		return authnResult{reason: reason}, now.Add(s.cfg.DenyTTL), nil
	case !slices.Contains(st.Audiences, s.cfg.Audience):
		// An authenticator that ignores audiences would accept any token.
		return authnResult{reason: "the hub did not confirm the audience"}, now.Add(s.cfg.DenyTTL), nil
	}
	until := now.Add(s.cfg.AuthnTTL)
	if exp.Before(until) {
		until = exp
	}
	return authnResult{user: userInfo{
		Username: st.User.Username,
		UID:      st.User.UID,
		Groups:   st.User.Groups,
		Extra:    st.User.Extra,
	}}, until, nil
}

// peerAddress returns the IP address of the caller, without its port, or
// "unknown" when the transport did not say.
func peerAddress(ctx context.Context) string {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return "unknown"
	}
	if tcp, ok := p.Addr.(*net.TCPAddr); ok {
		return tcp.IP.String()
	}
	addr := p.Addr.String()
	if host, _, err := net.SplitHostPort(addr); err == nil {
		return host
	}
	return addr
}
