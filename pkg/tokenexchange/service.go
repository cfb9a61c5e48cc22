package tokenexchange

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/time/rate"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/apimachinery/pkg/types"
	authenticationv1client "k8s.io/client-go/kubernetes/typed/authentication/v1"
	authorizationv1client "k8s.io/client-go/kubernetes/typed/authorization/v1"
	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/hubauth"
	"github.com/credbroker/credbroker/pkg/store"
	"github.com/credbroker/credbroker/pkg/token"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// Clusters looks up ClusterProfiles. Errors wrap errdefs.ErrNotFound when
// the profile is absent or being deleted, and errdefs.ErrFailedPrecondition
// when no agent can serve it or it names no server; Exchange then mints
// nothing.
type Clusters interface {
	Cluster(namespace, name string) (fleet.Cluster, error)
}

// Minter mints a token on a cluster; the broker passes the tunnel server.
type Minter interface {
	Mint(ctx context.Context, cluster fleet.ClusterRef, req *pb.MintRequest) (*pb.MintResponse, error)
}

// Grants is the broker's table of live grants (package grants): the
// exchange tells it of every token it mints, and asks it before it hands out
// a cached token. The broker passes its *grants.Registry.
type Grants interface {
	// Revoked reports whether the token of credentialID was revoked.
	Revoked(credentialID string) bool
	// Update records grants, as an agent of cluster reports them.
	Update(ctx context.Context, cluster fleet.ClusterRef, u *pb.GrantUpdate)
}

// Verifier checks a bearer token locally, without a hub call: its
// signature against the hub issuer's keys, its expiry and its audience. It
// returns the token's verified expiry (its exp claim), which bounds how
// long the token's TokenReview is cached, or an error wrapping
// errdefs.ErrUnauthenticated for a token that fails, or another errdefs
// sentinel (such as ErrUnavailable) when it cannot tell. The broker passes
// a *hubkeys.Keys.
type Verifier interface {
	Verify(ctx context.Context, token string) (expiry time.Time, err error)
}

// Accounts tells whether a hub ServiceAccount exists, and its UID, from an
// informer; grants.Accounts satisfies it. The hub's TokenReview may go on
// authenticating a deleted ServiceAccount's token for its own token cache's
// TTL (10 s on kube-apiserver), so the exchange asks this too.
type Accounts interface {
	// ServiceAccountUID returns the UID of the ServiceAccount
	// namespace/name, whether it exists, and whether that is known yet.
	ServiceAccountUID(namespace, name string) (uid types.UID, exists, known bool)
}

// Config configures the service. Durations left zero take their defaults.
type Config struct {
	// TokenReviews and AccessReviews are the hub's review APIs; required.
	TokenReviews  authenticationv1client.TokenReviewInterface
	AccessReviews authorizationv1client.SubjectAccessReviewInterface
	// Verifier checks every token not in the authentication cache before
	// its TokenReview, so that forged tokens cost no hub call; required.
	Verifier Verifier
	// Clusters and Minter are required.
	Clusters Clusters
	Minter   Minter
	// Grants learns of every minted token, and keeps a revoked token from
	// being served from the token cache. Default: none.
	Grants Grants
	// Accounts, when set, is asked whether the hub ServiceAccount of every
	// authenticated token still exists with the UID its TokenReview gave:
	// a token of a deleted or re-created account is Unauthenticated, even
	// while the hub's review or the broker's cache still accepts it.
	// Default: none; the broker passes its ServiceAccount informer.
	Accounts Accounts

	// Audience a consumer's hub token must carry. Default "credbroker"
	// (DefaultAudience; every default below has a Default constant).
	Audience string
	// MaxExpiration caps the lifetime of minted tokens; requests are clamped
	// to [MinExpiration, MaxExpiration]. Defaults 1h and 10m.
	MaxExpiration, MinExpiration time.Duration
	// AuthnTTL is how long a successful TokenReview is reused (never past the
	// token's expiry). Default 10s.
	AuthnTTL time.Duration
	// AllowTTL and DenyTTL are how long SubjectAccessReview decisions, and
	// failed TokenReviews, are reused. Defaults 10s and 2s.
	AllowTTL, DenyTTL time.Duration
	// ReviewRateLimit and ReviewBurst bound the TokenReviews of tokens not
	// in the cache, for all callers together, so that a flood of new or
	// forged tokens cannot crowd out the hub. Defaults 100/s and 200.
	ReviewRateLimit rate.Limit
	ReviewBurst     int
	// PeerReviewRateLimit and PeerReviewBurst bound the TokenReviews that
	// the calls from one peer address (IP, port ignored) trigger, so that
	// one pod cannot spend the budget above alone. Tokens served from the
	// authentication cache and tokens the Verifier refuses do not count.
	// Defaults 10/s and 20.
	PeerReviewRateLimit rate.Limit
	PeerReviewBurst     int
	// NamespaceReviewRateLimit and NamespaceReviewBurst bound, after the
	// peer limit and before the broker-wide one, the TokenReviews of the
	// tokens of one hub namespace, from whatever addresses, so that the
	// pods of one namespace cannot spend the broker-wide budget together.
	// A token's namespace is read once the Verifier has verified it: its
	// kubernetes.io namespace claim, or the <ns> of a
	// system:serviceaccount:<ns>:<name> sub. Tokens without one are limited
	// per peer only. Defaults DefaultNamespaceReviewRateLimit and
	// DefaultNamespaceReviewBurst.
	NamespaceReviewRateLimit rate.Limit
	NamespaceReviewBurst     int
	// ReviewTimeout bounds each TokenReview and SubjectAccessReview on the
	// hub. Default 5s.
	ReviewTimeout time.Duration
	// CacheSize bounds each cache. Default 10000.
	CacheSize int
	// RateLimit and RateBurst limit, per consumer, what costs the hub and
	// the spokes: its mints (token-cache misses that reach an agent) and
	// its hub reviews (TokenReviews and SubjectAccessReviews not served
	// from the decision caches). Answers served from the caches do not
	// count. A consumer over the limit is refused with ResourceExhausted
	// and a retry-after trailer (errdefs.RetryAfterKey). Calls of
	// Authenticate count one each. Defaults 20/s and 2000: a consumer's
	// start with 1,000 ClusterProfiles (1,000 SubjectAccessReviews and
	// 1,000 mints) fits the burst.
	RateLimit rate.Limit
	RateBurst int
	// HMACKey keys the authentication cache. Default: 32 random bytes.
	HMACKey []byte
	// Clock is injected for tests. Default: the real clock.
	Clock clock.PassiveClock
	// Log receives operational errors, such as hub reviews that failed;
	// Audit receives one line per exchange, unless AuditLog is set.
	// Default: discard.
	Log, Audit logr.Logger
	// AuditLog, when set, receives the exchange's audit lines in place of
	// Audit, encoded by the service itself as JSON lines (the object that
	// the broker binary's slog audit logger writes, tokens redacted), one
	// Write per line. It must be safe for concurrent Writes. The broker
	// binary passes its --audit-log-path writer.
	AuditLog io.Writer
	// Registerer receives the Service's metrics (credbroker_exchanges_total,
	// credbroker_exchange_duration_seconds,
	// credbroker_decision_cache_lookups_total). Nil registers them in a
	// private registry: counted, exposed nowhere. Two Services must not
	// share one Registerer.
	Registerer prometheus.Registerer
}

// Service implements credbrokerv1alpha1.TokenExchangeServer.
type Service struct {
	pb.UnsafeTokenExchangeServer

	cfg      Config
	authn    *store.Cache[cacheKey, authnResult]
	authz    *store.Cache[cacheKey, authzDecision]
	forgets  *forgets
	tokens   *store.Cache[cacheKey, minted]
	limiters *store.Cache[cacheKey, *rate.Limiter]
	reviews  *rate.Limiter
	// macs holds HMACs keyed with HMACKey, for the authentication cache
	// keys (bearerKey).
	macs sync.Pool
	// peerReviews holds a TokenReview limiter per peer address, and
	// namespaceReviews one per hub namespace.
	peerReviews      *store.Cache[string, *rate.Limiter]
	namespaceReviews *store.Cache[string, *rate.Limiter]
	metrics          *metrics
}

var _ pb.TokenExchangeServer = (*Service)(nil)

// New validates cfg, applies defaults and returns a Service.
func New(cfg Config) (*Service, error) {
	if cfg.TokenReviews == nil || cfg.AccessReviews == nil || cfg.Verifier == nil || cfg.Clusters == nil || cfg.Minter == nil {
		return nil, errors.New("tokenexchange: TokenReviews, AccessReviews, Verifier, Clusters and Minter are required")
	}
	setDefault(&cfg.Audience, DefaultAudience)
	setDefault(&cfg.MaxExpiration, DefaultMaxExpiration)
	setDefault(&cfg.MinExpiration, token.MinExpiration)
	setDefault(&cfg.AuthnTTL, DefaultAuthnTTL)
	setDefault(&cfg.AllowTTL, DefaultAllowTTL)
	setDefault(&cfg.DenyTTL, DefaultDenyTTL)
	setDefault(&cfg.ReviewTimeout, DefaultReviewTimeout)
	setDefault(&cfg.ReviewRateLimit, DefaultReviewRateLimit)
	setDefault(&cfg.ReviewBurst, DefaultReviewBurst)
	setDefault(&cfg.PeerReviewRateLimit, DefaultPeerReviewRateLimit)
	setDefault(&cfg.PeerReviewBurst, DefaultPeerReviewBurst)
	setDefault(&cfg.NamespaceReviewRateLimit, DefaultNamespaceReviewRateLimit)
	setDefault(&cfg.NamespaceReviewBurst, DefaultNamespaceReviewBurst)
	setDefault(&cfg.CacheSize, DefaultCacheSize)
	setDefault(&cfg.RateLimit, DefaultRateLimit)
	setDefault(&cfg.RateBurst, DefaultRateBurst)
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	if cfg.MinExpiration < token.MinExpiration || cfg.MaxExpiration < cfg.MinExpiration {
		return nil, fmt.Errorf("tokenexchange: want 10m <= MinExpiration (%s) <= MaxExpiration (%s)", cfg.MinExpiration, cfg.MaxExpiration)
	}
	if cfg.DenyTTL > cfg.AllowTTL {
		return nil, fmt.Errorf("tokenexchange: DenyTTL (%s) must not exceed AllowTTL (%s)", cfg.DenyTTL, cfg.AllowTTL)
	}
	if len(cfg.HMACKey) == 0 {
		cfg.HMACKey = make([]byte, 32)
		if _, err := rand.Read(cfg.HMACKey); err != nil {
			return nil, fmt.Errorf("tokenexchange: hmac key: %w", err)
		}
	}
	s := &Service{cfg: cfg, reviews: rate.NewLimiter(cfg.ReviewRateLimit, cfg.ReviewBurst),
		forgets: newForgets(cfg.Clock, max(cfg.AuthnTTL, cfg.AllowTTL)+2*cfg.ReviewTimeout)}
	s.macs.New = func() any { return hmac.New(sha256.New, cfg.HMACKey) }
	var err error
	if s.metrics, err = newMetrics(cfg.Registerer); err != nil {
		return nil, fmt.Errorf("tokenexchange: %w", err)
	}
	// A consumer that keeps calling has its decisions refreshed in the
	// background before they end, so that its calls never wait on the hub
	// nor meet a review limit; denials are not refreshed.
	decisions := store.Config{Size: cfg.CacheSize, MaxTTL: max(cfg.AuthnTTL, cfg.AllowTTL), Clock: cfg.Clock}
	authn, authz := decisions, decisions
	authn.RefreshWithin, authn.Refreshable = cfg.AuthnTTL/refreshShare, func(v any) bool { return v.(authnResult).reason == "" }
	authz.RefreshWithin, authz.Refreshable = cfg.AllowTTL/refreshShare, func(v any) bool { return v.(authzDecision).allowed }
	if s.authn, err = store.New[cacheKey, authnResult](authn); err != nil {
		return nil, fmt.Errorf("tokenexchange: %w", err)
	}
	if s.authz, err = store.New[cacheKey, authzDecision](authz); err != nil {
		return nil, fmt.Errorf("tokenexchange: %w", err)
	}
	if s.tokens, err = store.New[cacheKey, minted](store.Config{Size: cfg.CacheSize, MaxTTL: cfg.MaxExpiration, Clock: cfg.Clock}); err != nil {
		return nil, fmt.Errorf("tokenexchange: %w", err)
	}
	if s.limiters, err = store.New[cacheKey, *rate.Limiter](store.Config{Size: cfg.CacheSize, MaxTTL: time.Hour, Clock: cfg.Clock}); err != nil {
		return nil, fmt.Errorf("tokenexchange: %w", err)
	}
	if s.peerReviews, err = store.New[string, *rate.Limiter](store.Config{Size: cfg.CacheSize, MaxTTL: time.Hour, Clock: cfg.Clock}); err != nil {
		return nil, fmt.Errorf("tokenexchange: %w", err)
	}
	if s.namespaceReviews, err = store.New[string, *rate.Limiter](store.Config{Size: cfg.CacheSize, MaxTTL: time.Hour, Clock: cfg.Clock}); err != nil {
		return nil, fmt.Errorf("tokenexchange: %w", err)
	}
	return s, nil
}

func setDefault[T comparable](v *T, def T) {
	var zero T
	if *v == zero {
		*v = def
	}
}

// Exchange implements TokenExchange.Exchange.
func (s *Service) Exchange(ctx context.Context, req *pb.ExchangeRequest) (*pb.ExchangeResponse, error) {
	start := s.cfg.Clock.Now()
	rec := &auditRecord{}
	resp, err := s.exchange(ctx, req, rec)
	end := s.cfg.Clock.Now()
	s.audit(end, rec, req, err, end.Sub(start))
	if err == nil {
		return resp, nil
	}
	if wait, ok := errdefs.RetryAfter(err); ok {
		// Only a gRPC server has a stream to carry the trailer; the
		// message says the wait too.
		_ = grpc.SetTrailer(ctx, errdefs.RetryAfterTrailer(wait))
	}
	return nil, errdefs.ToStatus(err).Err()
}

func (s *Service) exchange(ctx context.Context, req *pb.ExchangeRequest, rec *auditRecord) (*pb.ExchangeResponse, error) {
	bearer, err := bearerToken(ctx)
	if err != nil {
		return nil, err
	}
	user, reviewed, err := s.authenticateReviewed(ctx, bearer)
	if err != nil {
		return nil, err
	}
	rec.user, rec.authenticated = user, true
	// The TokenReview is done; it counts against the consumer's limit
	// after the fact, since only it says who the consumer is. Its answer
	// is cached, so a consumer told to wait costs no second review.
	if reviewed {
		if err := s.allow(ctx, user, "hub reviews and mints"); err != nil {
			return nil, err
		}
	}
	r, err := parseRequest(req, s.cfg.Audience, s.cfg.MinExpiration, s.cfg.MaxExpiration)
	if err != nil {
		return nil, err
	}
	if err := s.authorize(ctx, user, r.cluster); err != nil {
		return nil, err
	}
	cluster, err := s.cfg.Clusters.Cluster(r.cluster.Namespace, r.cluster.Name)
	if err != nil {
		return nil, err
	}

	key := tokenKey(cluster.Ref, user, r)
	m, hit := s.tokens.Fresh(key)
	if !hit || s.revoked(m) {
		m, hit, err = s.unrevoked(ctx, key, cluster.Ref, s.minter(req, user, cluster.Ref, r))
	}
	rec.cacheHit = hit
	if err != nil {
		return nil, err
	}
	rec.minted, rec.answered = m, true
	return &pb.ExchangeResponse{
		Token:                    m.token,
		ExpirationTime:           timestamppb.New(m.expiry),
		Server:                   cluster.Server,
		CertificateAuthorityData: cluster.CAData,
		ServiceAccount:           &pb.ObjectReference{Namespace: m.serviceAccount.Namespace, Name: m.serviceAccount.Name},
		CredentialId:             m.credentialID,
	}, nil
}

// minter returns the mint, for user on cluster, of the token that req
// (parsed as r) asks for, which the token cache calls when it holds none:
// it spends the consumer's limit, asks the agent, checks its answer and
// records the grant.
func (s *Service) minter(req *pb.ExchangeRequest, user hubauth.User, cluster fleet.ClusterRef, r request) func(context.Context) (minted, time.Time, error) {
	mintReq := &pb.MintRequest{
		Subject:           &pb.Subject{Username: user.Username, Uid: user.UID, Groups: user.Groups},
		ServiceAccount:    req.GetServiceAccount(),
		Audiences:         r.audiences,
		ExpirationSeconds: int64(r.expiration / time.Second),
	}
	return func(ctx context.Context) (minted, time.Time, error) {
		if err := s.allow(ctx, user, "hub reviews and mints"); err != nil {
			return minted{}, time.Time{}, err
		}
		issued := s.cfg.Clock.Now()
		resp, err := s.cfg.Minter.Mint(ctx, cluster, mintReq)
		if err != nil {
			return minted{}, time.Time{}, err
		}
		// The agent may be compromised: nothing it says is cached, audited or
		// answered before the token's own claims agree with the request.
		m, err := checkAnswer(resp, r, s.cfg.Audience, s.cfg.Clock.Now(), s.cfg.MaxExpiration)
		if err != nil {
			s.cfg.Log.Error(err, "agent answer failed the broker's checks", fleet.LogCluster, cluster.String(), "check", checkOf(err))
			return minted{}, time.Time{}, fmt.Errorf("the agent of cluster %s answered with a token that failed the broker's checks: %w",
				cluster, errdefs.ErrUnavailable)
		}
		s.record(ctx, cluster, user, m)
		return m, store.Halfway(issued, m.expiry), nil
	}
}

// unrevoked returns the token of key from the cache, or one that mint
// mints on cluster, and whether it came from the cache.
func (s *Service) unrevoked(ctx context.Context, key cacheKey, cluster fleet.ClusterRef, mint func(context.Context) (minted, time.Time, error)) (minted, bool, error) {
	m, hit, err := s.tokens.Do(ctx, key, mint)
	// A revoked token is never handed out: its cache entry goes, and a new
	// token is minted in its place. A token the agent answers with that is
	// known revoked already is the agent's failure.
	for attempt := 0; err == nil && s.revoked(m); attempt++ {
		s.tokens.Remove(key)
		if attempt == maxRevokedRetries {
			s.cfg.Log.Info("agent answered with a revoked token", fleet.LogCluster, cluster.String(), fleet.LogCredentialID, m.credentialID)
			err = fmt.Errorf("the agent of cluster %s answered with a token that was revoked: %w", cluster, errdefs.ErrUnavailable)
			break
		}
		m, hit, err = s.tokens.Do(ctx, key, mint)
	}
	return m, hit, err
}

// maxRevokedRetries bounds the mints that replace a revoked token in one
// exchange.
const maxRevokedRetries = 2

// revoked reports whether m's token was revoked.
func (s *Service) revoked(m minted) bool {
	return s.cfg.Grants != nil && s.cfg.Grants.Revoked(m.credentialID)
}

// record tells the grant registry of a token just minted, so that this
// replica can revoke it before the agent reports its grant.
func (s *Service) record(ctx context.Context, cluster fleet.ClusterRef, user hubauth.User, m minted) {
	if s.cfg.Grants == nil || m.credentialID == "" {
		return
	}
	s.cfg.Grants.Update(ctx, cluster, &pb.GrantUpdate{Added: []*pb.Grant{{
		CredentialId:   m.credentialID,
		Cluster:        &pb.ObjectReference{Namespace: cluster.Namespace, Name: cluster.Name},
		ClusterUid:     string(cluster.UID),
		Subject:        &pb.Subject{Username: user.Username, Uid: user.UID, Groups: slices.Clone(user.Groups)},
		ServiceAccount: &pb.ObjectReference{Namespace: m.serviceAccount.Namespace, Name: m.serviceAccount.Name},
		Audiences:      slices.Clone(m.audiences),
		ExpirationTime: timestamppb.New(m.expiry),
		TokenSha256:    tokenSHA256(m.token),
	}}})
}

// tokenSHA256 is the hash of token that its grant records, for the API
// proxy.
func tokenSHA256(token string) []byte {
	sum := sha256.Sum256([]byte(token))
	return sum[:]
}

// allow spends one unit of user's rate limit (RateLimit, RateBurst) on
// something that costs the hub or a spoke: a hub review or a mint. Answers
// served from the caches spend nothing. When the limit is exceeded, it
// spends nothing either, and returns an error wrapping
// errdefs.ErrResourceExhausted that carries (errdefs.RetryAfter) and says
// how long to wait: the delay of the limiter's reservation.
func (s *Service) allow(ctx context.Context, user hubauth.User, what string) error {
	k := newKey()
	k.add(user.UID, user.Username)
	now := s.cfg.Clock.Now()
	lim, err := limiterFor(ctx, s.limiters, k.sum(), s.cfg.RateLimit, s.cfg.RateBurst, now)
	if err != nil {
		return err
	}
	return spend(ctx, lim, now, fmt.Sprintf("%s asked for more than %v %s per second (burst %d)", user.Username, s.cfg.RateLimit, what, s.cfg.RateBurst))
}
