package tokenexchange

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"
	josejwt "github.com/go-jose/go-jose/v4/jwt"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	authorizationv1 "k8s.io/api/authorization/v1"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/hubkeys"
	"github.com/credbroker/credbroker/pkg/token"
)

// fakeVerifier accepts every token, unless refuse says otherwise, and
// returns its exp claim as the verified expiry (zero when it has none).
type fakeVerifier struct {
	calls  atomic.Int32
	refuse func(token string) error
}

func (v *fakeVerifier) Verify(_ context.Context, tok string) (time.Time, error) {
	v.calls.Add(1)
	if v.refuse != nil {
		if err := v.refuse(tok); err != nil {
			return time.Time{}, err
		}
	}
	c, _ := token.ParseClaims(tok)
	return c.Expiry, nil
}

// fakeJWKS serves a fixed JWKS document.
type fakeJWKS struct {
	doc   []byte
	calls atomic.Int32
}

func (f *fakeJWKS) Fetch(context.Context) ([]byte, error) {
	f.calls.Add(1)
	return f.doc, nil
}

// issuer is the hub's service-account issuer in these tests, and other a
// key the hub does not know.
var testIssuer = sync.OnceValue(func() (k struct{ issuer, other *rsa.PrivateKey }) {
	var err error
	if k.issuer, err = rsa.GenerateKey(rand.Reader, 2048); err != nil {
		panic(err)
	}
	if k.other, err = rsa.GenerateKey(rand.Reader, 2048); err != nil {
		panic(err)
	}
	return k
})

func signToken(t *testing.T, alg jose.SignatureAlgorithm, key any, kid string, claims josejwt.Claims) string {
	t.Helper()
	signer, err := jose.NewSigner(jose.SigningKey{Algorithm: alg, Key: jose.JSONWebKey{Key: key, KeyID: kid}}, nil)
	require.NoError(t, err)
	tok, err := josejwt.Signed(signer).Claims(claims).Serialize()
	require.NoError(t, err)
	return tok
}

// consumerClaims are the claims of the consumer's token, as the hub issues
// it; mutate changes them.
func consumerClaims(mutate ...func(*josejwt.Claims)) josejwt.Claims {
	c := josejwt.Claims{
		Subject:   "consumer",
		Audience:  josejwt.Audience{"credbroker"},
		Expiry:    josejwt.NewNumericDate(t0.Add(time.Hour)),
		NotBefore: josejwt.NewNumericDate(t0),
		IssuedAt:  josejwt.NewNumericDate(t0),
	}
	for _, m := range mutate {
		m(&c)
	}
	return c
}

// withIssuerKeys makes the fixture verify tokens with hubkeys against the
// test issuer's key, "hub-key".
func withIssuerKeys(t *testing.T, f *fixture) *fakeJWKS {
	t.Helper()
	doc, err := json.Marshal(jose.JSONWebKeySet{Keys: []jose.JSONWebKey{{Key: &testIssuer().issuer.PublicKey, KeyID: "hub-key", Use: "sig", Algorithm: "RS256"}}})
	require.NoError(t, err)
	fetcher := &fakeJWKS{doc: doc}
	keys, err := hubkeys.New(hubkeys.Config{Fetcher: fetcher, Audience: "credbroker", Clock: f.clock})
	require.NoError(t, err)
	f.svc.cfg.Verifier = keys
	return fetcher
}

// Attack: tokens that the hub's issuer did not sign, or that are expired,
// not yet valid or for another audience, each cost a hub TokenReview.
// Defence: they are refused locally, before any hub call.
func TestForgedTokensCostNoTokenReview(t *testing.T) {
	k := testIssuer()
	enc := base64.RawURLEncoding.EncodeToString
	pubPEM := func() []byte {
		der, err := x509.MarshalPKIXPublicKey(&k.issuer.PublicKey)
		require.NoError(t, err)
		return pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der})
	}()
	claimsJSON, err := json.Marshal(consumerClaims())
	require.NoError(t, err)

	tests := []struct {
		name        string
		token       string
		wantCode    codes.Code
		wantMsg     string
		wantReviews int32
	}{
		{name: "signed by the hub", token: signToken(t, jose.RS256, k.issuer, "hub-key", consumerClaims()), wantCode: codes.OK, wantReviews: 1},
		{
			name: "bad signature", token: signToken(t, jose.RS256, k.other, "hub-key", consumerClaims()),
			wantCode: codes.Unauthenticated, wantMsg: "the token's signature does not verify with the hub issuer's keys: unauthenticated",
		},
		{
			name: "unknown kid", token: signToken(t, jose.RS256, k.other, "attacker-key", consumerClaims()),
			wantCode: codes.Unauthenticated, wantMsg: "the token names a signing key that the hub issuer does not publish: unauthenticated",
		},
		{
			name: "expired", token: signToken(t, jose.RS256, k.issuer, "hub-key", consumerClaims(func(c *josejwt.Claims) { c.Expiry = josejwt.NewNumericDate(t0.Add(-time.Hour)) })),
			wantCode: codes.Unauthenticated, wantMsg: "the token has expired: unauthenticated",
		},
		{
			name: "nbf in the future", token: signToken(t, jose.RS256, k.issuer, "hub-key", consumerClaims(func(c *josejwt.Claims) { c.NotBefore = josejwt.NewNumericDate(t0.Add(time.Hour)) })),
			wantCode: codes.Unauthenticated, wantMsg: "the token is not valid yet (nbf or iat in the future); check the clocks: unauthenticated",
		},
		{
			name: "wrong audience", token: signToken(t, jose.RS256, k.issuer, "hub-key", consumerClaims(func(c *josejwt.Claims) { c.Audience = josejwt.Audience{"https://kubernetes.default.svc"} })),
			wantCode: codes.Unauthenticated, wantMsg: `the token is not for audience "credbroker"; request a token with that audience: unauthenticated`,
		},
		{
			name: "alg none", token: enc([]byte(`{"alg":"none","kid":"hub-key"}`)) + "." + enc(claimsJSON) + ".",
			wantCode: codes.Unauthenticated, wantMsg: "the token is not signed with an asymmetric algorithm",
		},
		{
			name: "HS256 with the hub's public key as the secret", token: signToken(t, jose.HS256, pubPEM, "hub-key", consumerClaims()),
			wantCode: codes.Unauthenticated, wantMsg: "the token is not signed with an asymmetric algorithm",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFixture(t)
			withIssuerKeys(t, f)
			_, err := f.svc.Exchange(withBearer(tt.token), fleetA())
			st := status.Convert(err)
			assert.Equal(t, tt.wantCode, st.Code(), st.Message())
			assert.Contains(t, st.Message(), tt.wantMsg)
			assert.Equal(t, tt.wantReviews, f.reviews.tokenReviews.Load(), "hub TokenReviews")
			assert.NotContains(t, st.Message(), tt.token)
			assert.NotContains(t, f.audit.String(), tt.token)
		})
	}
}

func TestForgedTokensSpendNoReviewBudget(t *testing.T) {
	f := newFixture(t, func(c *Config) {
		c.ReviewRateLimit, c.ReviewBurst = 1, 1
		c.PeerReviewRateLimit, c.PeerReviewBurst = 1, 1
	})
	withIssuerKeys(t, f)
	k := testIssuer()
	ctx := fromPeer(withBearer, "10.0.0.1:1000")
	for i := range 100 {
		forged := signToken(t, jose.RS256, k.other, "hub-key", consumerClaims(func(c *josejwt.Claims) { c.ID = fmt.Sprint(i) }))
		_, err := f.svc.Exchange(ctx(forged), fleetA())
		require.Equal(t, codes.Unauthenticated, status.Code(err))
	}
	_, err := f.svc.Exchange(ctx(signToken(t, jose.RS256, k.issuer, "hub-key", consumerClaims())), fleetA())
	require.NoError(t, err, "a real token from the same address is still reviewed")
	assert.Equal(t, int32(1), f.reviews.tokenReviews.Load())
}

func TestUnloadedKeysAreUnavailable(t *testing.T) {
	f := newFixture(t)
	f.verifier.refuse = func(string) error {
		return fmt.Errorf("the broker has not yet loaded the hub issuer's signing keys; retry shortly: %w", errdefs.ErrUnavailable)
	}
	_, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
	assert.Equal(t, codes.Unavailable, status.Code(err))
	assert.Equal(t, int32(0), f.reviews.tokenReviews.Load())
}

// fromPeer returns a function that makes an incoming context for token,
// from the peer at addr.
func fromPeer(bearer func(string) context.Context, addr string) func(token string) context.Context {
	tcp, err := net.ResolveTCPAddr("tcp", addr)
	if err != nil {
		panic(err)
	}
	return func(token string) context.Context {
		return peer.NewContext(bearer(token), &peer.Peer{Addr: tcp})
	}
}

// Attack: one pod sends many tokens that pass local verification (real but
// revoked tokens, say) to spend the broker's shared review budget.
// Defence: TokenReviews per peer address are limited too.
func TestTokenReviewsArePerPeerLimited(t *testing.T) {
	f := newFixture(t, func(c *Config) { c.PeerReviewRateLimit, c.PeerReviewBurst = 1, 2 })
	attacker := fromPeer(withBearer, "10.0.0.1:1000")
	sameHostOtherPort := fromPeer(withBearer, "10.0.0.1:2000")
	neighbour := fromPeer(withBearer, "10.0.0.2:1000")
	revoked := func(i int) string { return jwt(fmt.Sprintf(`{"sub":"revoked-%d"}`, i)) }

	// A real token, reviewed and cached before the flood.
	_, err := f.svc.Exchange(attacker(consumerToken), fleetA())
	require.NoError(t, err)

	_, err = f.svc.Exchange(attacker(revoked(1)), fleetA())
	require.Equal(t, codes.Unauthenticated, status.Code(err))
	for _, ctx := range []context.Context{attacker(revoked(2)), sameHostOtherPort(revoked(3))} {
		_, err = f.svc.Exchange(ctx, fleetA())
		st := status.Convert(err)
		require.Equal(t, codes.ResourceExhausted, st.Code(), st.Message())
		assert.Equal(t, "your address sent more than 1 new tokens per second for review; retry after 1s: resource exhausted", st.Message())
	}
	assert.Equal(t, int32(2), f.reviews.tokenReviews.Load())

	// Cached tokens do not count, and other addresses have budgets of their own.
	_, err = f.svc.Exchange(attacker(consumerToken), fleetA())
	require.NoError(t, err, "a cached token is served whatever its address's review budget")
	_, err = f.svc.Exchange(neighbour(consumerTokenExpiring(t0.Add(2*time.Hour))), fleetA())
	require.NoError(t, err, "another address has its own budget")
	assert.Equal(t, int32(3), f.reviews.tokenReviews.Load())

	// Tokens refused locally do not count either.
	f.verifier.refuse = func(string) error { return fmt.Errorf("forged: %w", errdefs.ErrUnauthenticated) }
	f.clock.Step(time.Second)
	for i := range 10 {
		_, err = f.svc.Exchange(neighbour(revoked(100+i)), fleetA())
		require.Equal(t, codes.Unauthenticated, status.Code(err))
	}
	f.verifier.refuse = nil
	_, err = f.svc.Exchange(neighbour(consumerTokenExpiring(t0.Add(3*time.Hour))), fleetA())
	require.NoError(t, err)

	// The budget refills.
	_, err = f.svc.Exchange(attacker(revoked(4)), fleetA())
	assert.Equal(t, codes.Unauthenticated, status.Code(err), "the hub's answer, after a second")
}

// Attack: a hub token whose exp the broker reads differently from the
// verifier (here a fraction of a second, which the verifier accepts and a
// strict reader of Kubernetes tokens refuses) keeps its TokenReview cached
// for the whole AuthnTTL, past its expiry.
// Defence: the cache is bounded by the expiry the verifier checked.
func TestAuthnCacheBoundedByVerifiedExpiry(t *testing.T) {
	f := newFixture(t)
	withIssuerKeys(t, f)
	signer, err := jose.NewSigner(jose.SigningKey{Algorithm: jose.RS256, Key: jose.JSONWebKey{Key: testIssuer().issuer, KeyID: "hub-key"}}, nil)
	require.NoError(t, err)
	tok, err := josejwt.Signed(signer).Claims(map[string]any{
		"sub": "consumer", "aud": []string{"credbroker"}, "iat": t0.Unix(), "nbf": t0.Unix(),
		"exp": float64(t0.Add(3*time.Second).Unix()) + 0.5,
	}).Serialize()
	require.NoError(t, err)

	_, err = f.svc.Exchange(withBearer(tok), fleetA())
	require.NoError(t, err)
	f.clock.Step(2 * time.Second)
	_, err = f.svc.Exchange(withBearer(tok), fleetA())
	require.NoError(t, err)
	assert.Equal(t, int32(1), f.reviews.tokenReviews.Load())

	f.clock.Step(2 * time.Second) // past exp, within the verifier's leeway, well before AuthnTTL
	_, err = f.svc.Exchange(withBearer(tok), fleetA())
	require.NoError(t, err)
	assert.Equal(t, int32(2), f.reviews.tokenReviews.Load(), "the hub was asked again once the token expired")
}

// Attack: the hub's authenticator ignores the requested audience (a
// webhook or an old authenticator that accepts any token of its issuer)
// and authenticates a token minted for another audience, such as the API
// server's own.
// Defence: the review must echo the broker's audience in status.audiences.
func TestTokenReviewMustConfirmTheAudience(t *testing.T) {
	tests := []struct {
		name      string
		audiences func(requested []string) []string
		wantCode  codes.Code
	}{
		{name: "echoes the broker's audience", audiences: func(r []string) []string { return r }, wantCode: codes.OK},
		{name: "reports no audience", audiences: func([]string) []string { return nil }, wantCode: codes.Unauthenticated},
		{name: "reports the API server's audience", audiences: func([]string) []string { return []string{"https://kubernetes.default.svc"} }, wantCode: codes.Unauthenticated},
		{name: "reports a look-alike audience", audiences: func([]string) []string { return []string{"credbroker ", "Credbroker"} }, wantCode: codes.Unauthenticated},
		{name: "reports the broker's among others", audiences: func(r []string) []string { return append([]string{"other"}, r...) }, wantCode: codes.OK},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFixture(t)
			f.reviews.audiences = tt.audiences
			_, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
			st := status.Convert(err)
			require.Equal(t, tt.wantCode, st.Code(), st.Message())
			if tt.wantCode != codes.OK {
				assert.Equal(t, `the hub rejected the token for audience "credbroker": the hub did not confirm the audience: unauthenticated`, st.Message())
				assert.Zero(t, f.reviews.accessReviews.Load(), "an unconfirmed token reached authorization")
				assert.Zero(t, f.minter.calls.Load(), "an unconfirmed token was exchanged")
			}
		})
	}
}

// Attack: a SubjectAccessReview that carries only the username loses the
// groups, uid and extra the TokenReview reported. A grant to a group
// (system:serviceaccounts:<ns>) then never applies, and a hub authorizer
// that denies by uid or extra (a deleted-and-recreated ServiceAccount, a
// pod-bound token) is not consulted about them.
// Defence: the review carries the whole hub user, as the TokenReview
// reported it.
func TestAccessReviewCarriesTheWholeUser(t *testing.T) {
	f := newFixture(t)
	_, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
	require.NoError(t, err)

	f.reviews.mu.Lock()
	defer f.reviews.mu.Unlock()
	require.Len(t, f.reviews.sars, 1)
	assert.Equal(t, authorizationv1.SubjectAccessReviewSpec{
		User:   "system:serviceaccount:hub:consumer",
		UID:    "consumer-uid",
		Groups: []string{"system:serviceaccounts"},
		Extra:  map[string]authorizationv1.ExtraValue{"authentication.kubernetes.io/pod-name": {"consumer-0"}},
		ResourceAttributes: &authorizationv1.ResourceAttributes{
			Group: "multicluster.x-k8s.io", Resource: "clusterprofiles", Subresource: "token",
			Verb: "create", Namespace: "fleet", Name: "a",
		},
	}, f.reviews.sars[0])
}

// Attack: about ten pods of one hub namespace, without any credbroker
// RBAC, send new tokens that verify (fresh TokenRequests of the
// namespace's own ServiceAccounts, or a stash of tokens of deleted ones)
// from twenty addresses. Each address stays within its own review budget,
// and together they spend the broker-wide one, so a consumer of another
// namespace whose authentication cache entry expired is refused with
// ResourceExhausted.
// Defence: the claims of a verified token are the hub's own, so reviews
// are limited per hub namespace too, before the broker-wide limit.
func TestOneNamespaceCannotSpendTheReviewBudget(t *testing.T) {
	f := newFixture(t) // the shipped defaults
	exp := t0.Add(time.Hour).Unix()
	// Half the crowd's tokens carry the kubernetes.io claim, half only a
	// ServiceAccount's sub: both name the namespace crowd.
	crowdToken := func(i int) string {
		if i%2 == 0 {
			return jwt(fmt.Sprintf(`{"sub":"system:serviceaccount:crowd:sa-%d","kubernetes.io":{"namespace":"crowd"},"exp":%d}`, i, exp))
		}
		return jwt(fmt.Sprintf(`{"sub":"system:serviceaccount:crowd:sa-%d","exp":%d}`, i, exp))
	}
	refused := 0
	for p := range 20 {
		from := fromPeer(withBearer, fmt.Sprintf("10.0.1.%d:1000", p+1))
		for i := range 30 {
			_, err := f.svc.Exchange(from(crowdToken(p*100+i)), fleetA())
			st := status.Convert(err)
			switch st.Code() {
			case codes.Unauthenticated: // reviewed: the hub does not know it
			case codes.ResourceExhausted:
				refused++
			default:
				t.Fatalf("crowd token %d from peer %d: %v", i, p, err)
			}
		}
	}
	crowdReviews := f.reviews.tokenReviews.Load()
	t.Logf("the crowd: 600 new tokens from 20 addresses, %d reviewed, %d refused", crowdReviews, refused)
	assert.Equal(t, int32(DefaultNamespaceReviewBurst), crowdReviews, "one namespace's reviews are bounded by its own budget")
	assert.Equal(t, 600-DefaultNamespaceReviewBurst, refused)

	// From a fresh address of the crowd, the namespace's budget refuses.
	_, err := f.svc.Exchange(fromPeer(withBearer, "10.0.1.99:1000")(crowdToken(9999)), fleetA())
	st := status.Convert(err)
	require.Equal(t, codes.ResourceExhausted, st.Code(), st.Message())
	assert.Equal(t, fmt.Sprintf(`the tokens of hub namespace "crowd" asked for more than %d new token reviews per second; retry after 1s: resource exhausted`,
		DefaultNamespaceReviewRateLimit), st.Message())

	// A bystander of namespace hub, from an address of its own, with a new
	// token: still reviewed, and served.
	bystander := jwt(fmt.Sprintf(`{"sub":"consumer","kubernetes.io":{"namespace":"hub"},"exp":%d}`, exp))
	_, err = f.svc.Exchange(fromPeer(withBearer, "10.0.2.1:1000")(bystander), fleetA())
	require.NoError(t, err, "a consumer of another namespace is still reviewed")
	assert.Equal(t, crowdReviews+1, f.reviews.tokenReviews.Load())
}

func TestReviewNamespace(t *testing.T) {
	tests := []struct {
		name, claims, want string
	}{
		{name: "kubernetes.io claim", claims: `{"sub":"system:serviceaccount:a:x","kubernetes.io":{"namespace":"b"}}`, want: "b"},
		{name: "sub of a ServiceAccount", claims: `{"sub":"system:serviceaccount:a:x"}`, want: "a"},
		{name: "empty kubernetes.io namespace", claims: `{"sub":"system:serviceaccount:a:x","kubernetes.io":{"namespace":""}}`, want: "a"},
		{name: "sub of no ServiceAccount", claims: `{"sub":"consumer"}`},
		{name: "sub without a name", claims: `{"sub":"system:serviceaccount:a"}`},
		{name: "sub with an empty namespace", claims: `{"sub":"system:serviceaccount::x"}`},
		{name: "no claims", claims: `{}`},
		{name: "kubernetes.io of the wrong type", claims: `{"sub":"system:serviceaccount:a:x","kubernetes.io":"b"}`, want: "a"},
		{name: "namespace of the wrong type", claims: `{"kubernetes.io":{"namespace":7}}`},
		{name: "not JSON", claims: `not json`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, reviewNamespace(jwt(tt.claims)))
		})
	}
	assert.Empty(t, reviewNamespace("not-a-jwt"))
}
