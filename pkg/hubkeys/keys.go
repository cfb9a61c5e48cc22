package hubkeys

import (
	"context"
	"crypto/ecdsa"
	"crypto/rsa"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-jose/go-jose/v4"
	"github.com/go-jose/go-jose/v4/jwt"
	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/singleflight"
	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/pkg/errdefs"
)

// Algorithms are the only signature algorithms a token may use: the
// asymmetric ones kube-apiserver signs service-account tokens with (RS256
// for RSA keys, ES256/384/512 for EC keys) and their RSA relatives. Never
// "none" and never an HMAC algorithm, so a public key can never serve as a
// shared secret.
var Algorithms = []jose.SignatureAlgorithm{
	jose.RS256, jose.RS384, jose.RS512,
	jose.PS256, jose.PS384, jose.PS512,
	jose.ES256, jose.ES384, jose.ES512,
}

// MaxDocumentSize is the largest JWKS document accepted, in bytes.
const MaxDocumentSize = 1 << 20

// Defaults of Config.
const (
	DefaultLeeway             = jwt.DefaultLeeway // 1m
	DefaultRefreshInterval    = 5 * time.Minute
	DefaultMinRefreshInterval = 15 * time.Second
	DefaultFetchTimeout       = 5 * time.Second
)

// Fetcher fetches the issuer's JSON Web Key Set document (RFC 7517 §5).
type Fetcher interface {
	Fetch(ctx context.Context) ([]byte, error)
}

// Config configures Keys. Durations left zero take their defaults.
type Config struct {
	// Fetcher fetches the key set; required. See FromHub and FromFile.
	Fetcher Fetcher
	// Audience must be one of a token's aud claims; required.
	Audience string
	// Leeway is the clock skew allowed when checking exp, nbf and iat.
	// Default DefaultLeeway (1m, what go-jose and kube-apiserver's own
	// service-account authenticator allow).
	Leeway time.Duration
	// RefreshInterval is how often Run fetches the key set. Default 5m.
	RefreshInterval time.Duration
	// MinRefreshInterval is the least time between two fetches. A token
	// naming an unknown key id triggers a fetch, at most this often, so a
	// flood of made-up key ids costs the hub at most one fetch per
	// MinRefreshInterval. Default 15s; at most RefreshInterval.
	MinRefreshInterval time.Duration
	// FetchTimeout bounds each fetch. Default 5s.
	FetchTimeout time.Duration
	// Clock is injected for tests. Default: the real clock.
	Clock clock.Clock
	// Log receives key set changes and fetch failures. Default: discard.
	Log logr.Logger
	// Registerer receives the metrics (credbroker_hub_token_rejections_total,
	// credbroker_hub_keys_fetches_total). Nil registers them in a private
	// registry: counted, exposed nowhere.
	Registerer prometheus.Registerer
}

// Keys holds the hub issuer's current key set and verifies tokens against
// it. It is safe for concurrent use.
type Keys struct {
	cfg     Config
	set     atomic.Pointer[keySet]
	group   singleflight.Group
	metrics *metrics

	mu        sync.Mutex // guards the fields below
	lastFetch time.Time  // start of the last fetch, good or bad
	lastErr   string     // the last fetch error logged, to log each only once
}

// keySet is one parsed JWKS document.
type keySet struct {
	keys   []jose.JSONWebKey
	digest [sha256.Size]byte
}

// New validates cfg and returns Keys that hold no key yet: the first Verify
// or Run fetches them.
func New(cfg Config) (*Keys, error) {
	if cfg.Fetcher == nil {
		return nil, errors.New("hubkeys: Config.Fetcher is required")
	}
	if cfg.Audience == "" {
		return nil, errors.New("hubkeys: Config.Audience is required")
	}
	setDefault(&cfg.Leeway, DefaultLeeway)
	setDefault(&cfg.RefreshInterval, DefaultRefreshInterval)
	setDefault(&cfg.MinRefreshInterval, DefaultMinRefreshInterval)
	setDefault(&cfg.FetchTimeout, DefaultFetchTimeout)
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	switch {
	case cfg.Leeway < 0 || cfg.RefreshInterval < 0 || cfg.MinRefreshInterval < 0 || cfg.FetchTimeout < 0:
		return nil, errors.New("hubkeys: durations must not be negative")
	case cfg.MinRefreshInterval > cfg.RefreshInterval:
		return nil, fmt.Errorf("hubkeys: MinRefreshInterval (%s) must not exceed RefreshInterval (%s)", cfg.MinRefreshInterval, cfg.RefreshInterval)
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	return &Keys{cfg: cfg, metrics: m}, nil
}

func setDefault(v *time.Duration, def time.Duration) {
	if *v == 0 {
		*v = def
	}
}

// Run fetches the key set now and then every RefreshInterval (every
// MinRefreshInterval while no key set has loaded yet) until ctx is done,
// then returns nil. A failed fetch keeps the last good key set.
func (k *Keys) Run(ctx context.Context) error {
	for {
		k.refresh(ctx)
		wait := k.cfg.RefreshInterval
		if k.set.Load() == nil {
			wait = k.cfg.MinRefreshInterval
		}
		t := k.cfg.Clock.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C():
		}
	}
}

// Load fetches the key set now, whenever the last fetch was, and returns
// why it failed, if it did. Use it to fail fast at start-up on a key set
// that is known to be at hand, such as a file.
func (k *Keys) Load(ctx context.Context) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.lastFetch = k.cfg.Clock.Now()
	return k.fetch(ctx)
}

// Loaded reports whether a key set has been loaded.
func (k *Keys) Loaded() bool { return k.set.Load() != nil }

// Verify checks raw, a compact JWS, without calling anyone but, at most,
// the Fetcher: that it is signed with one of Algorithms by a key of the
// current set (named by its kid header; a token without a kid is tried
// against every key), that it has not expired and is already valid (with
// Leeway), and that its aud claim includes Audience. It returns the
// token's verified expiry, its exp claim, which may lie up to Leeway in the
// past.
//
// A kid that the set lacks triggers a fetch of the key set, unless one
// started less than MinRefreshInterval ago. Verify returns an error wrapping
// errdefs.ErrUnauthenticated for a token that fails, and one wrapping
// errdefs.ErrUnavailable when no key set has ever been loaded. Errors never
// contain any part of raw.
func (k *Keys) Verify(ctx context.Context, raw string) (time.Time, error) {
	tok, err := jwt.ParseSigned(raw, Algorithms)
	if err != nil {
		if _, ok := errors.AsType[*jose.ErrUnexpectedSignatureAlgorithm](err); ok {
			return time.Time{}, k.reject(reasonAlgorithm, "the token is not signed with an asymmetric algorithm that a Kubernetes service-account issuer uses (RS256, ES256, …)")
		}
		return time.Time{}, k.reject(reasonMalformed, "the token is not a signed JWT")
	}
	kid := tok.Headers[0].KeyID

	set := k.set.Load()
	if set == nil {
		if set = k.refresh(ctx); set == nil {
			return time.Time{}, fmt.Errorf("the broker has not yet loaded the hub issuer's signing keys; retry shortly: %w", errdefs.ErrUnavailable)
		}
	}
	candidates := set.lookup(kid)
	if len(candidates) == 0 {
		// A new key of the hub, or a made-up key id: fetch at most every
		// MinRefreshInterval to tell.
		if candidates = k.refresh(ctx).lookup(kid); len(candidates) == 0 {
			return time.Time{}, k.reject(reasonUnknownKey, "the token names a signing key that the hub issuer does not publish")
		}
	}

	var claims jwt.Claims
	verified := false
	for _, key := range candidates {
		if err := tok.Claims(key.Key, &claims); err == nil {
			verified = true
			break
		}
	}
	if !verified {
		return time.Time{}, k.reject(reasonSignature, "the token's signature does not verify with the hub issuer's keys")
	}
	if claims.Expiry == nil {
		return time.Time{}, k.reject(reasonExpired, "the token has no expiry (exp claim)")
	}
	err = claims.ValidateWithLeeway(jwt.Expected{AnyAudience: jwt.Audience{k.cfg.Audience}, Time: k.cfg.Clock.Now()}, k.cfg.Leeway)
	switch {
	case err == nil:
		return claims.Expiry.Time(), nil
	case errors.Is(err, jwt.ErrExpired):
		return time.Time{}, k.reject(reasonExpired, "the token has expired")
	case errors.Is(err, jwt.ErrNotValidYet), errors.Is(err, jwt.ErrIssuedInTheFuture):
		return time.Time{}, k.reject(reasonNotYetValid, "the token is not valid yet (nbf or iat in the future); check the clocks")
	case errors.Is(err, jwt.ErrInvalidAudience):
		return time.Time{}, k.reject(reasonAudience, fmt.Sprintf("the token is not for audience %q; request a token with that audience", k.cfg.Audience))
	default:
		return time.Time{}, k.reject(reasonMalformed, "the token's claims are invalid")
	}
}

func (k *Keys) reject(reason, msg string) error {
	k.metrics.rejections.WithLabelValues(reason).Inc()
	return fmt.Errorf("%s: %w", msg, errdefs.ErrUnauthenticated)
}

// lookup returns the keys that may have signed a token with kid: those
// with that id, or every key when kid is empty. It is safe on a nil set.
func (s *keySet) lookup(kid string) []jose.JSONWebKey {
	if s == nil {
		return nil
	}
	if kid == "" {
		return s.keys
	}
	var out []jose.JSONWebKey
	for _, key := range s.keys {
		if key.KeyID == kid {
			out = append(out, key)
		}
	}
	return out
}

// refresh fetches the key set unless a fetch started less than
// MinRefreshInterval ago, and returns the current set (nil if none ever
// loaded). Concurrent callers share one fetch; each waits at most until its
// ctx ends.
func (k *Keys) refresh(ctx context.Context) *keySet {
	ch := k.group.DoChan("", func() (any, error) {
		k.mu.Lock()
		defer k.mu.Unlock()
		now := k.cfg.Clock.Now()
		if !k.lastFetch.IsZero() && now.Sub(k.lastFetch) < k.cfg.MinRefreshInterval {
			return nil, nil
		}
		k.lastFetch = now
		_ = k.fetch(context.WithoutCancel(ctx)) // logged; the current set stays
		return nil, nil
	})
	select {
	case <-ctx.Done():
	case <-ch:
	}
	return k.set.Load()
}

// fetch loads the key set once; a failure keeps the current set, and is
// logged and returned. Callers hold k.mu.
func (k *Keys) fetch(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, k.cfg.FetchTimeout)
	defer cancel()
	doc, err := k.cfg.Fetcher.Fetch(ctx)
	if err == nil {
		if cur := k.set.Load(); cur != nil && cur.digest == sha256.Sum256(doc) {
			k.lastErr = ""
			k.metrics.fetches.WithLabelValues("unchanged").Inc()
			return nil
		}
	}
	var set *keySet
	if err == nil {
		set, err = parse(doc)
	}
	if err != nil {
		k.metrics.fetches.WithLabelValues("error").Inc()
		if msg := err.Error(); msg != k.lastErr {
			k.lastErr = msg
			k.cfg.Log.Error(err, "cannot fetch the hub issuer's keys, keeping the loaded ones", "loaded", k.set.Load() != nil)
		}
		return err
	}
	k.lastErr = ""
	k.set.Store(set)
	k.metrics.fetches.WithLabelValues("changed").Inc()
	kids := make([]string, 0, len(set.keys))
	for _, key := range set.keys {
		kids = append(kids, key.KeyID)
	}
	k.cfg.Log.Info("loaded the hub issuer's keys", "kids", kids)
	return nil
}

// parse reads a JWKS document and keeps its RSA and EC public keys for
// signing; it skips keys of other types or uses, and keys it cannot read,
// so that one odd key does not hide the others. It fails when no key is
// left.
func parse(doc []byte) (*keySet, error) {
	if len(doc) > MaxDocumentSize {
		return nil, fmt.Errorf("hubkeys: the key set is %d bytes, more than %d", len(doc), MaxDocumentSize)
	}
	var raw struct {
		Keys []json.RawMessage `json:"keys"`
	}
	if err := json.Unmarshal(doc, &raw); err != nil {
		return nil, fmt.Errorf("hubkeys: the key set is not a JWKS document: %w", err)
	}
	set := &keySet{digest: sha256.Sum256(doc)}
	for _, r := range raw.Keys {
		var key jose.JSONWebKey
		if err := key.UnmarshalJSON(r); err != nil {
			continue
		}
		if key.Use != "" && key.Use != "sig" {
			continue
		}
		if key.Algorithm != "" && !slices.Contains(Algorithms, jose.SignatureAlgorithm(key.Algorithm)) {
			continue
		}
		switch key.Key.(type) {
		case *rsa.PublicKey, *ecdsa.PublicKey:
		case *rsa.PrivateKey, *ecdsa.PrivateKey:
			key = key.Public()
		default: // symmetric ("oct"), Ed25519 and anything else
			continue
		}
		set.keys = append(set.keys, key)
	}
	if len(set.keys) == 0 {
		return nil, fmt.Errorf("hubkeys: the key set holds no RSA or EC signing key (of %d keys)", len(raw.Keys))
	}
	return set, nil
}
