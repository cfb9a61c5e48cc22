package tokenexchange

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"net"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	authenticationv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/hubauth"
	"github.com/credbroker/credbroker/pkg/store"
	"github.com/credbroker/credbroker/pkg/token"
)

// authnResult is a cached TokenReview outcome: a user, or why there is none.
type authnResult struct {
	user   hubauth.User
	reason string
	// seq is the number of the review (forgets.next).
	seq uint64
}

// bearerToken reads the "authorization: Bearer <token>" metadata and checks
// that the token has the shape of a JWT.
func bearerToken(ctx context.Context) (string, error) {
	values := metadata.ValueFromIncomingContext(ctx, "authorization")
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
func (s *Service) authenticate(ctx context.Context, bearer string) (hubauth.User, error) {
	user, _, err := s.authenticateReviewed(ctx, bearer)
	return user, err
}

// authenticateReviewed is authenticate, and also reports whether this call
// sent the TokenReview (the token was not in the cache, and no concurrent
// call was reviewing it already).
func (s *Service) authenticateReviewed(ctx context.Context, bearer string) (hubauth.User, bool, error) {
	key := s.bearerKey(bearer)
	res, hit := s.authn.Fresh(key)
	hit = hit && !s.authnStale(res)
	var (
		reviewed bool
		err      error
	)
	if !hit {
		res, hit, reviewed, err = s.reviewOrWait(ctx, key, bearer)
	}
	s.metrics.lookedUp(authnCache, hit)
	if err != nil {
		return hubauth.User{}, false, err
	}
	if res.reason != "" {
		return hubauth.User{}, false, fmt.Errorf("the hub rejected the token for audience %q: %s: %w", s.cfg.Audience, res.reason, errdefs.ErrUnauthenticated)
	}
	if err := s.checkAccount(res.user); err != nil {
		return hubauth.User{}, false, err
	}
	return res.user, reviewed, nil
}

// checkAccount refuses a hub ServiceAccount's token when Accounts knows
// that the account was created again under the same name, or that it is
// gone and the informer saw it go (SubjectChanged) lately, while the hub's
// own token cache may still authenticate its tokens. An account that the
// informer does not hold and never saw go is one created a moment ago,
// which the informer has not listed yet: the TokenReview decides.
func (s *Service) checkAccount(user hubauth.User) error {
	if s.cfg.Accounts == nil {
		return nil
	}
	rest, ok := strings.CutPrefix(user.Username, serviceAccountPrefix)
	ns, name, ok2 := strings.Cut(rest, ":")
	if !ok || !ok2 {
		return nil // not a ServiceAccount
	}
	uid, exists, known := s.cfg.Accounts.ServiceAccountUID(ns, name)
	switch {
	case !known:
		return nil // the TokenReview decides alone until the informer has listed
	case !exists && s.forgets.subjectChangedRecently(user.Username):
		return fmt.Errorf("the hub ServiceAccount %s/%s of the token no longer exists: %w", ns, name, errdefs.ErrUnauthenticated)
	case exists && user.UID != "" && types.UID(user.UID) != uid:
		return fmt.Errorf("the hub ServiceAccount %s/%s was deleted and created again; the token is of the old one: %w", ns, name, errdefs.ErrUnauthenticated)
	}
	return nil
}

// reviewOrWait is the authentication cache's Do for bearer, under key:
// the cached result, or a TokenReview of its own or of a concurrent call.
// reviewed reports that it sent the review.
func (s *Service) reviewOrWait(ctx context.Context, key cacheKey, bearer string) (res authnResult, hit, reviewed bool, err error) {
	var sent atomic.Bool
	res, hit, err = freshDecision(ctx, s.authn, key, s.authnStale, func(ctx context.Context) (authnResult, time.Time, error) {
		return s.tokenReview(ctx, bearer, &sent)
	})
	return res, hit, sent.Load(), err
}

// authnStale reports whether res authenticated a hub user whose
// ServiceAccount changed after its review started.
func (s *Service) authnStale(res authnResult) bool {
	return res.reason == "" && s.forgets.subjectStale(res.user.Username, res.seq)
}

// bearerKey is the authentication cache key of bearer: its HMAC with the
// service's key, so that the cache holds no token. The MAC and the buffer
// that bearer is copied into for it are pooled: the key costs no
// allocation.
func (s *Service) bearerKey(bearer string) cacheKey {
	mac := s.macs.Get().(hash.Hash)
	mac.Reset()
	k := newKey()
	*k.buf = append(*k.buf, bearer...)
	_, _ = mac.Write(*k.buf)
	var key cacheKey
	copy(key[:], mac.Sum((*k.buf)[:0]))
	clear((*k.buf)[:len(bearer)]) // no token goes back to the pool
	k.release()
	s.macs.Put(mac)
	return key
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
	if err := s.allowReview(ctx, bearer, exp, now); err != nil {
		return authnResult{}, time.Time{}, err
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ReviewTimeout)
	defer cancel()
	seq := s.forgets.next()
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
	return authnResult{seq: seq, user: hubauth.User{
		Username: st.User.Username,
		UID:      st.User.UID,
		Groups:   st.User.Groups,
		Extra:    st.User.Extra,
	}}, until, nil
}

// errNotWorthRefreshing ends the refresh of a decision whose token
// expires before the refresh would outlive the decision.
var errNotWorthRefreshing = errors.New("the token expires before its refreshed review would be of use")

// allowReview spends the review limits on bearer's review: its peer
// address's (only for a token not known yet: a refresh ahead of time is of
// a token the hub accepted, and the address limit is against floods of new
// ones), its hub namespace's, and the broker's.
func (s *Service) allowReview(ctx context.Context, bearer string, exp, now time.Time) error {
	if store.Refreshing(ctx) {
		if exp.Sub(now) <= s.cfg.AuthnTTL/refreshShare {
			return errNotWorthRefreshing
		}
	} else {
		addr := peerAddress(ctx)
		lim, err := limiterFor(ctx, s.peerReviews, addr, s.cfg.PeerReviewRateLimit, s.cfg.PeerReviewBurst, now)
		if err != nil {
			return err
		}
		if err := spend(ctx, lim, now, fmt.Sprintf("your address sent more than %v new tokens per second for review", s.cfg.PeerReviewRateLimit)); err != nil {
			return err
		}
	}
	if ns := reviewNamespace(bearer); ns != "" {
		lim, err := limiterFor(ctx, s.namespaceReviews, ns, s.cfg.NamespaceReviewRateLimit, s.cfg.NamespaceReviewBurst, now)
		if err != nil {
			return err
		}
		if err := spend(ctx, lim, now, fmt.Sprintf("the tokens of hub namespace %q asked for more than %v new token reviews per second",
			ns, s.cfg.NamespaceReviewRateLimit)); err != nil {
			return err
		}
	}
	return spend(ctx, s.reviews, now, fmt.Sprintf("the broker is reviewing more than %v new tokens per second", s.cfg.ReviewRateLimit))
}

// reviewNamespace returns the hub namespace of a token that the Verifier
// has verified, whose claims are then the hub issuer's own: its
// kubernetes.io namespace claim or, without one, the namespace of a
// ServiceAccount's sub. It returns "" when the token names none, or none
// that can be a namespace (a DNS label of at most 63 characters).
func reviewNamespace(bearer string) string {
	parts := strings.Split(bearer, ".")
	if len(parts) != 3 {
		return ""
	}
	raw, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		return ""
	}
	var claims struct {
		Sub        json.RawMessage `json:"sub"`
		Kubernetes json.RawMessage `json:"kubernetes.io"`
	}
	if json.Unmarshal(raw, &claims) != nil {
		return ""
	}
	var k struct {
		Namespace json.RawMessage `json:"namespace"`
	}
	var ns, sub string
	if json.Unmarshal(claims.Kubernetes, &k) == nil && json.Unmarshal(k.Namespace, &ns) == nil && ns != "" {
		return namespaceOrNone(ns)
	}
	if json.Unmarshal(claims.Sub, &sub) != nil {
		return ""
	}
	rest, ok := strings.CutPrefix(sub, serviceAccountPrefix)
	if !ok {
		return ""
	}
	ns, name, ok := strings.Cut(rest, ":")
	if !ok || name == "" {
		return ""
	}
	return namespaceOrNone(ns)
}

// namespaceOrNone returns ns when it is a DNS label, as every namespace
// is, and "" otherwise.
func namespaceOrNone(ns string) string {
	if len(validation.IsDNS1123Label(ns)) > 0 {
		return ""
	}
	return ns
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
