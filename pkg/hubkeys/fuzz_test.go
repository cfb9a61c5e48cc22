package hubkeys

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/go-jose/go-jose/v4"
	"github.com/go-jose/go-jose/v4/jwt"

	"github.com/credbroker/credbroker/pkg/errdefs"
)

// FuzzVerify feeds untrusted bearer tokens to Verify: it must not panic,
// must refuse as Unauthenticated, and must never quote the token. A token
// it accepts has three segments and is at most 16 KiB.
func FuzzVerify(f *testing.F) {
	k := testKeys()
	good := sign(f, jose.RS256, k.rsa1, "rsa-1", goodClaims())
	payload := enc(`{"aud":["credbroker"],"exp":1767229200}`)
	for _, seed := range []string{
		good,
		sign(f, jose.ES256, k.ec, "ec-1", goodClaims()),
		sign(f, jose.RS256, k.other, "made-up", goodClaims()),
		sign(f, jose.HS256, []byte("0123456789abcdef0123456789abcdef"), "rsa-1", goodClaims()),
		sign(f, jose.RS256, k.rsa1, "rsa-1", claimsWith(func(c *jwt.Claims) { c.Expiry = nil })),
		enc(`{"alg":"none"}`) + "." + payload + ".",
		enc(`{"alg":"RS256","kid":"rsa-1","crit":["exp"]}`) + "." + payload + "." + enc("sig"),
		enc(`{"alg":"RS256","kid":"rsa-1"}`) + "." + enc(`{"exp":"soon","aud":7}`) + "." + enc("sig"),
		enc(`{"alg":"ES256","jwk":{"kty":"EC"}}`) + "." + payload + "." + enc("sig"),
		"..", "a.b.c", "", strings.Repeat("a", 100) + ".." + strings.Repeat("b", 100),
	} {
		f.Add(seed)
	}
	keys, _ := newKeys(f, &fakeFetcher{doc: issuerJWKS(f)})
	f.Fuzz(func(t *testing.T, tok string) {
		exp, err := keys.Verify(context.Background(), tok)
		if err == nil {
			if exp.IsZero() {
				t.Fatal("Verify accepted a token without returning its expiry")
			}
			if n := len(strings.Split(tok, ".")); n != 3 {
				t.Fatalf("Verify accepted a token of %d segments", n)
			}
			if len(tok) > 16<<10 {
				t.Fatalf("Verify accepted a token of %d bytes", len(tok))
			}
			return
		}
		if !exp.IsZero() {
			t.Fatalf("Verify returned expiry %v with error %v", exp, err)
		}
		if !errors.Is(err, errdefs.ErrUnauthenticated) {
			t.Fatalf("Verify: %v, want an error wrapping ErrUnauthenticated", err)
		}
		if len(tok) >= 8 && strings.Contains(err.Error(), tok) {
			t.Fatalf("Verify's error quotes the token: %v", err)
		}
	})
}

// FuzzParse feeds JWKS documents to parse: it must not panic and must keep
// only RSA and EC public keys.
func FuzzParse(f *testing.F) {
	f.Add(issuerJWKS(f))
	f.Add([]byte(`{"keys":[{"kty":"oct","k":"c2VjcmV0"},{"kty":"RSA","n":"AQAB","e":"AQAB"}]}`))
	f.Add([]byte(`{"keys":[{"kty":"EC","crv":"P-256","x":"","y":""}]}`))
	f.Add([]byte(`{"keys":null}`))
	f.Add([]byte(`[]`))
	f.Fuzz(func(t *testing.T, doc []byte) {
		set, err := parse(doc)
		if err != nil {
			return
		}
		for _, key := range set.keys {
			if !key.IsPublic() {
				t.Fatalf("parse kept a key that is not public: %T", key.Key)
			}
		}
	})
}
