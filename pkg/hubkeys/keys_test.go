package hubkeys

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"
	"github.com/go-jose/go-jose/v4/jwt"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/token"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// The issuer's keys, generated once: RSA keys sign like kube-apiserver's
// default, the EC key like an issuer configured with one.
var testKeys = sync.OnceValue(func() (k struct {
	rsa1, rsa2, other *rsa.PrivateKey
	ec                *ecdsa.PrivateKey
}) {
	var err error
	for _, p := range []**rsa.PrivateKey{&k.rsa1, &k.rsa2, &k.other} {
		if *p, err = rsa.GenerateKey(rand.Reader, 2048); err != nil {
			panic(err)
		}
	}
	if k.ec, err = ecdsa.GenerateKey(elliptic.P256(), rand.Reader); err != nil {
		panic(err)
	}
	return k
})

// jwks returns a JWKS document of the public halves of keys, by kid.
func jwks(t testing.TB, keys map[string]any) []byte {
	t.Helper()
	var set jose.JSONWebKeySet
	for kid, key := range keys {
		set.Keys = append(set.Keys, jose.JSONWebKey{Key: key, KeyID: kid, Use: "sig"})
	}
	doc, err := json.Marshal(set)
	require.NoError(t, err)
	return doc
}

func issuerJWKS(t testing.TB) []byte {
	k := testKeys()
	return jwks(t, map[string]any{"rsa-1": &k.rsa1.PublicKey, "ec-1": &k.ec.PublicKey})
}

// sign returns a compact JWS of claims, signed with key under alg; kid is
// put in the header when not empty.
func sign(t testing.TB, alg jose.SignatureAlgorithm, key any, kid string, claims any) string {
	t.Helper()
	sk := jose.SigningKey{Algorithm: alg, Key: key}
	if kid != "" {
		sk.Key = jose.JSONWebKey{Key: key, KeyID: kid}
	}
	signer, err := jose.NewSigner(sk, (&jose.SignerOptions{}).WithType("JWT"))
	require.NoError(t, err)
	tok, err := jwt.Signed(signer).Claims(claims).Serialize()
	require.NoError(t, err)
	return tok
}

// goodClaims are what the hub's issuer puts in a consumer's token.
func goodClaims() jwt.Claims {
	return jwt.Claims{
		Issuer:    "https://hub.example",
		Subject:   "system:serviceaccount:hub:consumer",
		Audience:  jwt.Audience{"credbroker"},
		Expiry:    jwt.NewNumericDate(t0.Add(time.Hour)),
		NotBefore: jwt.NewNumericDate(t0),
		IssuedAt:  jwt.NewNumericDate(t0),
	}
}

func claimsWith(mutate func(*jwt.Claims)) jwt.Claims {
	c := goodClaims()
	mutate(&c)
	return c
}

// fakeFetcher serves doc, or fails with err, and counts its calls.
type fakeFetcher struct {
	mu    sync.Mutex
	doc   []byte
	err   error
	calls atomic.Int32
}

func (f *fakeFetcher) Fetch(context.Context) ([]byte, error) {
	f.calls.Add(1)
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.doc, f.err
}

func (f *fakeFetcher) serve(doc []byte, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.doc, f.err = doc, err
}

func newKeys(t testing.TB, f Fetcher, mutate ...func(*Config)) (*Keys, *clocktesting.FakeClock) {
	t.Helper()
	clk := clocktesting.NewFakeClock(t0)
	cfg := Config{Fetcher: f, Audience: "credbroker", Clock: clk}
	for _, m := range mutate {
		m(&cfg)
	}
	k, err := New(cfg)
	require.NoError(t, err)
	return k, clk
}

// verifyErr is Verify for tests that check only its error.
func verifyErr(ctx context.Context, k *Keys, raw string) error {
	_, err := k.Verify(ctx, raw)
	return err
}

func enc(s string) string { return base64.RawURLEncoding.EncodeToString([]byte(s)) }

func TestVerify(t *testing.T) {
	k := testKeys()
	payload := enc(`{"aud":["credbroker"],"exp":1767229200,"sub":"system:serviceaccount:hub:consumer"}`)
	good := sign(t, jose.RS256, k.rsa1, "rsa-1", goodClaims())
	goodParts := splitJWS(t, good)
	pubPEM := func() []byte {
		der, err := x509.MarshalPKIXPublicKey(&k.rsa1.PublicKey)
		require.NoError(t, err)
		return pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der})
	}()

	tests := []struct {
		name       string
		token      string
		wantReason string // empty: accepted
		wantMsg    string
	}{
		{name: "RS256 from the issuer", token: good},
		{name: "ES256 from the issuer", token: sign(t, jose.ES256, k.ec, "ec-1", goodClaims())},
		{name: "no kid: every key is tried", token: sign(t, jose.RS256, k.rsa1, "", goodClaims())},
		{name: "one of several audiences", token: sign(t, jose.RS256, k.rsa1, "rsa-1", claimsWith(func(c *jwt.Claims) { c.Audience = jwt.Audience{"other", "credbroker"} }))},
		{name: "expired within the leeway", token: sign(t, jose.RS256, k.rsa1, "rsa-1", claimsWith(func(c *jwt.Claims) { c.Expiry = jwt.NewNumericDate(t0.Add(-30 * time.Second)) }))},
		{name: "nbf within the leeway", token: sign(t, jose.RS256, k.rsa1, "rsa-1", claimsWith(func(c *jwt.Claims) { c.NotBefore = jwt.NewNumericDate(t0.Add(30 * time.Second)) }))},
		{
			name: "signed by another key under the issuer's kid", token: sign(t, jose.RS256, k.other, "rsa-1", goodClaims()),
			wantReason: reasonSignature, wantMsg: "the token's signature does not verify with the hub issuer's keys",
		},
		{
			name: "no kid, signed by another key", token: sign(t, jose.RS256, k.other, "", goodClaims()),
			wantReason: reasonSignature, wantMsg: "signature does not verify",
		},
		{
			name: "payload swapped under a real signature", token: goodParts[0] + "." + payload + "." + goodParts[2],
			wantReason: reasonSignature, wantMsg: "signature does not verify",
		},
		{
			name: "random signature", token: goodParts[0] + "." + goodParts[1] + "." + enc("not a signature"),
			wantReason: reasonSignature, wantMsg: "signature does not verify",
		},
		{
			name: "EC signature under the RSA key's kid", token: sign(t, jose.ES256, k.ec, "rsa-1", goodClaims()),
			wantReason: reasonSignature, wantMsg: "signature does not verify",
		},
		{
			name: "unknown kid", token: sign(t, jose.RS256, k.other, "made-up", goodClaims()),
			wantReason: reasonUnknownKey, wantMsg: "the token names a signing key that the hub issuer does not publish",
		},
		{
			name: "expired", token: sign(t, jose.RS256, k.rsa1, "rsa-1", claimsWith(func(c *jwt.Claims) { c.Expiry = jwt.NewNumericDate(t0.Add(-2 * time.Minute)) })),
			wantReason: reasonExpired, wantMsg: "the token has expired",
		},
		{
			name: "no exp", token: sign(t, jose.RS256, k.rsa1, "rsa-1", claimsWith(func(c *jwt.Claims) { c.Expiry = nil })),
			wantReason: reasonExpired, wantMsg: "the token has no expiry (exp claim)",
		},
		{
			name: "nbf in the future", token: sign(t, jose.RS256, k.rsa1, "rsa-1", claimsWith(func(c *jwt.Claims) { c.NotBefore = jwt.NewNumericDate(t0.Add(2 * time.Minute)) })),
			wantReason: reasonNotYetValid, wantMsg: "the token is not valid yet (nbf or iat in the future); check the clocks",
		},
		{
			name: "iat in the future", token: sign(t, jose.RS256, k.rsa1, "rsa-1", claimsWith(func(c *jwt.Claims) { c.IssuedAt = jwt.NewNumericDate(t0.Add(2 * time.Minute)) })),
			wantReason: reasonNotYetValid, wantMsg: "not valid yet",
		},
		{
			name: "the API server's default audience", token: sign(t, jose.RS256, k.rsa1, "rsa-1", claimsWith(func(c *jwt.Claims) { c.Audience = jwt.Audience{"https://hub.example"} })),
			wantReason: reasonAudience, wantMsg: `the token is not for audience "credbroker"; request a token with that audience`,
		},
		{
			name: "no audience", token: sign(t, jose.RS256, k.rsa1, "rsa-1", claimsWith(func(c *jwt.Claims) { c.Audience = nil })),
			wantReason: reasonAudience, wantMsg: "not for audience",
		},
		{
			name: "alg none", token: enc(`{"alg":"none","kid":"rsa-1"}`) + "." + payload + ".",
			wantReason: reasonAlgorithm, wantMsg: "the token is not signed with an asymmetric algorithm",
		},
		{
			name: "HS256 with the issuer's public key as the secret", token: sign(t, jose.HS256, pubPEM, "rsa-1", goodClaims()),
			wantReason: reasonAlgorithm, wantMsg: "not signed with an asymmetric algorithm",
		},
		{
			name: "HS256 with the JWK's modulus as the secret", token: sign(t, jose.HS256, k.rsa1.N.Bytes(), "rsa-1", goodClaims()),
			wantReason: reasonAlgorithm, wantMsg: "not signed with an asymmetric algorithm",
		},
		{
			name: "EdDSA", token: enc(`{"alg":"EdDSA","kid":"rsa-1"}`) + "." + payload + "." + enc("sig"),
			wantReason: reasonAlgorithm, wantMsg: "not signed with an asymmetric algorithm",
		},
		{
			name: "header is not JSON", token: enc(`not json`) + "." + payload + "." + enc("sig"),
			wantReason: reasonMalformed, wantMsg: "the token is not a signed JWT",
		},
		{
			name: "payload is not JSON", token: signRaw(t, k.rsa1, "rsa-1", []byte("not json")),
			wantReason: reasonSignature, wantMsg: "signature does not verify",
		},
		{
			name: "two segments", token: goodParts[0] + "." + goodParts[1],
			wantReason: reasonMalformed, wantMsg: "not a signed JWT",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := &fakeFetcher{doc: issuerJWKS(t)}
			keys, _ := newKeys(t, f)
			var before float64
			if tt.wantReason != "" {
				before = testutil.ToFloat64(keys.metrics.rejections.WithLabelValues(tt.wantReason))
			}
			exp, err := keys.Verify(context.Background(), tt.token)
			if tt.wantReason == "" {
				require.NoError(t, err)
				c, err := token.ParseClaims(tt.token)
				require.NoError(t, err)
				assert.Equal(t, c.Expiry, exp, "the verified expiry is the token's exp")
				return
			}
			require.Error(t, err)
			assert.True(t, exp.IsZero(), "an expiry returned with an error")
			assert.ErrorIs(t, err, errdefs.ErrUnauthenticated)
			assert.Contains(t, err.Error(), tt.wantMsg)
			assert.NotContains(t, err.Error(), tt.token)
			for _, part := range strings.Split(tt.token, ".") {
				if len(part) > 8 {
					assert.NotContains(t, err.Error(), part, "the error quotes the token")
				}
			}
			assert.Equal(t, before+1, testutil.ToFloat64(keys.metrics.rejections.WithLabelValues(tt.wantReason)))
		})
	}
}

// signRaw signs payload bytes as they are, which need not be JSON claims.
func signRaw(t *testing.T, key *rsa.PrivateKey, kid string, payload []byte) string {
	t.Helper()
	signer, err := jose.NewSigner(jose.SigningKey{Algorithm: jose.RS256, Key: jose.JSONWebKey{Key: key, KeyID: kid}}, nil)
	require.NoError(t, err)
	jws, err := signer.Sign(payload)
	require.NoError(t, err)
	out, err := jws.CompactSerialize()
	require.NoError(t, err)
	return out
}

func splitJWS(t *testing.T, tok string) []string {
	t.Helper()
	parts := strings.Split(tok, ".")
	require.Len(t, parts, 3)
	return parts
}

func TestUnknownKidRefreshesAtMostEveryMinRefreshInterval(t *testing.T) {
	k := testKeys()
	f := &fakeFetcher{doc: issuerJWKS(t)}
	keys, clk := newKeys(t, f)
	ctx := context.Background()
	require.NoError(t, verifyErr(ctx, keys, sign(t, jose.RS256, k.rsa1, "rsa-1", goodClaims())))
	require.Equal(t, int32(1), f.calls.Load(), "the first token loads the keys")

	// The hub adds a key and signs with it before the broker's next fetch.
	f.serve(jwks(t, map[string]any{"rsa-1": &k.rsa1.PublicKey, "rsa-2": &k.rsa2.PublicKey}), nil)
	rotated := sign(t, jose.RS256, k.rsa2, "rsa-2", goodClaims())
	err := verifyErr(ctx, keys, rotated)
	assert.ErrorIs(t, err, errdefs.ErrUnauthenticated, "the keys were fetched less than MinRefreshInterval ago")
	assert.Equal(t, int32(1), f.calls.Load())

	clk.Step(DefaultMinRefreshInterval)
	require.NoError(t, verifyErr(ctx, keys, rotated), "an unknown kid refreshes the keys")
	assert.Equal(t, int32(2), f.calls.Load(), "one refresh")
	require.NoError(t, verifyErr(ctx, keys, rotated))
	assert.Equal(t, int32(2), f.calls.Load(), "a known kid does not refresh")

	// A flood of made-up key ids, one after another and all at once.
	flood := func() {
		var wg sync.WaitGroup
		for i := range 50 {
			tok := sign(t, jose.RS256, k.other, fmt.Sprintf("made-up-%d", i), goodClaims())
			require.ErrorIs(t, verifyErr(ctx, keys, tok), errdefs.ErrUnauthenticated)
			wg.Go(func() { assert.ErrorIs(t, verifyErr(ctx, keys, tok), errdefs.ErrUnauthenticated) })
		}
		wg.Wait()
	}
	clk.Step(DefaultMinRefreshInterval - time.Second)
	flood()
	assert.Equal(t, int32(2), f.calls.Load(), "no refresh within MinRefreshInterval of the last")
	clk.Step(time.Second)
	flood()
	assert.Equal(t, int32(3), f.calls.Load(), "one refresh per MinRefreshInterval, whatever the flood")
	clk.Step(DefaultMinRefreshInterval)
	flood()
	assert.Equal(t, int32(4), f.calls.Load())
}

func TestFailsClosedUntilKeysLoad(t *testing.T) {
	k := testKeys()
	f := &fakeFetcher{err: errors.New("dial tcp 10.0.0.1:6443: connection refused")}
	keys, clk := newKeys(t, f)
	ctx := context.Background()
	good := sign(t, jose.RS256, k.rsa1, "rsa-1", goodClaims())

	for range 3 {
		err := verifyErr(ctx, keys, good)
		require.ErrorIs(t, err, errdefs.ErrUnavailable)
		assert.Equal(t, "the broker has not yet loaded the hub issuer's signing keys; retry shortly: unavailable", err.Error())
	}
	assert.Equal(t, int32(1), f.calls.Load(), "a hub that is down is asked at most every MinRefreshInterval")
	assert.False(t, keys.Loaded())

	f.serve([]byte(`{"keys":[]}`), nil)
	clk.Step(DefaultMinRefreshInterval)
	assert.ErrorIs(t, verifyErr(ctx, keys, good), errdefs.ErrUnavailable, "an empty key set is no key set")

	f.serve(issuerJWKS(t), nil)
	clk.Step(DefaultMinRefreshInterval)
	require.NoError(t, verifyErr(ctx, keys, good))
	assert.True(t, keys.Loaded())
	assert.Equal(t, int32(3), f.calls.Load())
}

func TestKeepsTheLastGoodKeySet(t *testing.T) {
	k := testKeys()
	f := &fakeFetcher{doc: issuerJWKS(t)}
	keys, clk := newKeys(t, f)
	ctx := context.Background()
	good := sign(t, jose.RS256, k.rsa1, "rsa-1", goodClaims())
	require.NoError(t, verifyErr(ctx, keys, good))

	for _, bad := range []struct {
		doc []byte
		err error
	}{
		{err: errors.New("connection refused")},
		{doc: []byte("<html>proxy error</html>")},
		{doc: []byte(`{"keys":[{"kty":"oct","k":"c2VjcmV0","kid":"rsa-1"}]}`)},
	} {
		f.serve(bad.doc, bad.err)
		clk.Step(DefaultMinRefreshInterval)
		// An unknown kid makes the refresh happen.
		assert.ErrorIs(t, verifyErr(ctx, keys, sign(t, jose.RS256, k.other, "made-up", goodClaims())), errdefs.ErrUnauthenticated)
		require.NoError(t, verifyErr(ctx, keys, good), "a failed refresh dropped the loaded keys")
	}
	assert.Equal(t, int32(4), f.calls.Load())
}

func TestRunRefreshesPeriodically(t *testing.T) {
	k := testKeys()
	f := &fakeFetcher{err: errors.New("connection refused")}
	keys, clk := newKeys(t, f)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- keys.Run(ctx) }()

	// sleeping waits until Run sleeps, that is, until it has fetched.
	sleeping := func() { require.Eventually(t, clk.HasWaiters, 10*time.Second, time.Millisecond) }
	sleeping()
	assert.Equal(t, int32(1), f.calls.Load())
	f.serve(issuerJWKS(t), nil)
	clk.Step(DefaultMinRefreshInterval) // retried soon while nothing has loaded
	sleeping()
	assert.Equal(t, int32(2), f.calls.Load())
	assert.True(t, keys.Loaded())

	// Loaded: the next fetch waits for RefreshInterval, and picks up a new key.
	f.serve(jwks(t, map[string]any{"rsa-2": &k.rsa2.PublicKey}), nil)
	clk.Step(DefaultRefreshInterval - time.Second)
	sleeping()
	assert.Equal(t, int32(2), f.calls.Load())
	clk.Step(time.Second)
	sleeping()
	assert.Equal(t, int32(3), f.calls.Load())
	assert.NoError(t, verifyErr(ctx, keys, sign(t, jose.RS256, k.rsa2, "rsa-2", claimsWith(func(c *jwt.Claims) {
		c.Expiry = jwt.NewNumericDate(clk.Now().Add(time.Hour))
	}))))
	assert.Equal(t, int32(3), f.calls.Load())

	cancel()
	assert.NoError(t, <-done)
}

func TestFromFileReloadsChanges(t *testing.T) {
	k := testKeys()
	path := filepath.Join(t.TempDir(), "jwks.json")
	require.NoError(t, os.WriteFile(path, issuerJWKS(t), 0o600))
	keys, clk := newKeys(t, FromFile(path))
	ctx := context.Background()
	require.NoError(t, verifyErr(ctx, keys, sign(t, jose.RS256, k.rsa1, "rsa-1", goodClaims())))

	require.NoError(t, os.WriteFile(path, jwks(t, map[string]any{"rsa-2": &k.rsa2.PublicKey}), 0o600))
	clk.Step(DefaultMinRefreshInterval)
	require.NoError(t, verifyErr(ctx, keys, sign(t, jose.RS256, k.rsa2, "rsa-2", goodClaims())))
	clk.Step(DefaultMinRefreshInterval)
	// rsa-1 is gone: a refresh (triggered by its now unknown kid) finds it no more.
	assert.ErrorIs(t, verifyErr(ctx, keys, sign(t, jose.RS256, k.rsa1, "rsa-1", goodClaims())), errdefs.ErrUnauthenticated)

	require.NoError(t, os.Remove(path))
	clk.Step(DefaultMinRefreshInterval)
	assert.ErrorIs(t, verifyErr(ctx, keys, sign(t, jose.RS256, k.other, "made-up", goodClaims())), errdefs.ErrUnauthenticated)
	require.NoError(t, verifyErr(ctx, keys, sign(t, jose.RS256, k.rsa2, "rsa-2", goodClaims())), "a missing file keeps the loaded keys")
}

func TestParse(t *testing.T) {
	k := testKeys()
	privateJWK, err := json.Marshal(jose.JSONWebKey{Key: k.rsa1, KeyID: "private"})
	require.NoError(t, err)
	publicJWK, err := json.Marshal(jose.JSONWebKey{Key: &k.rsa1.PublicKey, KeyID: "rsa-1", Algorithm: "RS256", Use: "sig"})
	require.NoError(t, err)

	tests := []struct {
		name     string
		doc      string
		wantKids []string
		wantErr  string
	}{
		{name: "kube-apiserver's shape", doc: `{"keys":[` + string(publicJWK) + `]}`, wantKids: []string{"rsa-1"}},
		{name: "private key: its public half", doc: `{"keys":[` + string(privateJWK) + `]}`, wantKids: []string{"private"}},
		{
			name:     "odd keys skipped",
			doc:      `{"keys":[{"kty":"oct","k":"c2VjcmV0","kid":"hmac"},{"kty":"RSA","kid":"broken"},{"kty":"OKP","crv":"Ed25519","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo","kid":"ed"},` + string(publicJWK) + `]}`,
			wantKids: []string{"rsa-1"},
		},
		{name: "encryption key skipped", doc: `{"keys":[` + strings.Replace(string(publicJWK), `"use":"sig"`, `"use":"enc"`, 1) + `]}`, wantErr: "hubkeys: the key set holds no RSA or EC signing key (of 1 keys)"},
		{name: "HMAC algorithm skipped", doc: `{"keys":[` + strings.Replace(string(publicJWK), `"alg":"RS256"`, `"alg":"HS256"`, 1) + `]}`, wantErr: "holds no RSA or EC signing key"},
		{name: "no keys", doc: `{"keys":[]}`, wantErr: "hubkeys: the key set holds no RSA or EC signing key (of 0 keys)"},
		{name: "not JSON", doc: `<html>`, wantErr: "hubkeys: the key set is not a JWKS document"},
		{name: "too large", doc: `{"keys":[],"pad":"` + string(make([]byte, MaxDocumentSize)) + `"}`, wantErr: "more than 1048576"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			set, err := parse([]byte(tt.doc))
			if tt.wantErr != "" {
				assert.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			var kids []string
			for _, key := range set.keys {
				assert.True(t, key.IsPublic())
				kids = append(kids, key.KeyID)
			}
			assert.Equal(t, tt.wantKids, kids)
		})
	}
}

func TestNewValidates(t *testing.T) {
	f := &fakeFetcher{}
	tests := []struct {
		name    string
		cfg     Config
		wantErr string
	}{
		{name: "no fetcher", cfg: Config{Audience: "a"}, wantErr: "hubkeys: Config.Fetcher is required"},
		{name: "no audience", cfg: Config{Fetcher: f}, wantErr: "hubkeys: Config.Audience is required"},
		{name: "negative", cfg: Config{Fetcher: f, Audience: "a", Leeway: -time.Second}, wantErr: "hubkeys: durations must not be negative"},
		{
			name: "min above interval", cfg: Config{Fetcher: f, Audience: "a", RefreshInterval: time.Second, MinRefreshInterval: time.Minute},
			wantErr: "hubkeys: MinRefreshInterval (1m0s) must not exceed RefreshInterval (1s)",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := New(tt.cfg)
			assert.EqualError(t, err, tt.wantErr)
		})
	}
}
