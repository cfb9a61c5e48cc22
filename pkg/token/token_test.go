package token

import (
	"encoding/base64"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func jwt(payload string) string {
	enc := base64.RawURLEncoding.EncodeToString
	return enc([]byte(`{"alg":"RS256"}`)) + "." + enc([]byte(payload)) + "." + enc([]byte("signature"))
}

func TestCheckShape(t *testing.T) {
	tests := []struct {
		name    string
		token   string
		wantErr string
	}{
		{name: "jwt", token: jwt(`{"sub":"a"}`)},
		{name: "unsigned jwt", token: "e30.e30."},
		{name: "empty", token: "", wantErr: "bearer token is not a JWT: empty"},
		{name: "opaque", token: "abcdef", wantErr: "bearer token is not a JWT: 1 segments, want 3"},
		{name: "four segments", token: "a.b.c.d", wantErr: "bearer token is not a JWT: 4 segments, want 3"},
		{name: "empty header", token: ".b.c", wantErr: "bearer token is not a JWT: segment 1 is empty"},
		{name: "padding", token: "a.b=.c", wantErr: "bearer token is not a JWT: segment 2 is not base64url"},
		{name: "space", token: "a.b.c d", wantErr: "bearer token is not a JWT: segment 3 is not base64url"},
		{name: "too long", token: "a.b." + strings.Repeat("c", MaxLength), wantErr: "bearer token is not a JWT: 16388 bytes is longer than 16384"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := CheckShape(tt.token)
			if tt.wantErr == "" {
				require.NoError(t, err)
				return
			}
			require.EqualError(t, err, tt.wantErr)
			assert.ErrorIs(t, err, ErrMalformed)
		})
	}
}

func TestID(t *testing.T) {
	tests := []struct {
		name  string
		token string
		want  string
	}{
		{name: "jti", token: jwt(`{"jti":"5b3d2c"}`), want: "JTI=5b3d2c"},
		{name: "no jti", token: jwt(`{"sub":"a"}`), want: Fingerprint(jwt(`{"sub":"a"}`))},
		{name: "payload not json", token: jwt(`not json`), want: Fingerprint(jwt(`not json`))},
		{name: "jti with a line break", token: jwt(`{"jti":"a\nb"}`), want: Fingerprint(jwt(`{"jti":"a\nb"}`))},
		{name: "jti with a space", token: jwt(`{"jti":"a b"}`), want: Fingerprint(jwt(`{"jti":"a b"}`))},
		{name: "jti not ascii", token: jwt(`{"jti":"é"}`), want: Fingerprint(jwt(`{"jti":"é"}`))},
		{name: "jti too long", token: jwt(`{"jti":"` + strings.Repeat("a", 129) + `"}`), want: Fingerprint(jwt(`{"jti":"` + strings.Repeat("a", 129) + `"}`))},
		{name: "not a jwt", token: "opaque", want: Fingerprint("opaque")},
		{name: "jti beside a malformed claim", token: jwt(`{"jti":"5b3d2c","sub":5}`), want: Fingerprint(jwt(`{"jti":"5b3d2c","sub":5}`))},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, ID(tt.token))
			if c, err := ParseClaims(tt.token); err == nil {
				assert.Equal(t, tt.want, IDOf(c, tt.token), "IDOf of the parsed claims")
			}
		})
	}
}

func TestExpiry(t *testing.T) {
	tests := []struct {
		name   string
		token  string
		want   time.Time
		wantOK bool
	}{
		{name: "exp", token: jwt(`{"exp":2000000000}`), want: time.Unix(2000000000, 0), wantOK: true},
		{name: "no exp", token: jwt(`{"sub":"a"}`)},
		{name: "exp not a number", token: jwt(`{"exp":"soon"}`)},
		{name: "negative exp", token: jwt(`{"exp":-1}`)},
		{name: "exp past year 9999", token: jwt(`{"exp":253402300800}`)},
		{name: "exp beside a malformed claim", token: jwt(`{"exp":2000000000,"aud":[1]}`)},
		{name: "not a jwt", token: "opaque"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := Expiry(tt.token)
			assert.Equal(t, tt.wantOK, ok)
			assert.True(t, tt.want.Equal(got), "got %v", got)
		})
	}
}

func TestFingerprintHidesToken(t *testing.T) {
	tok := jwt(`{"sub":"secret"}`)
	fp := Fingerprint(tok)
	assert.Regexp(t, `^sha256:[0-9a-f]{16}$`, fp)
	assert.NotContains(t, fp, tok[:10])
}

// FuzzCheckShapeAndID feeds untrusted bearer tokens to CheckShape and ID.
// Invariants: an accepted token has three segments, of which only the
// signature may be empty, and is at most MaxLength bytes; an error never
// quotes the token; ID is "JTI=<jti>" or the token's Fingerprint, and never
// contains the signature segment. Seeds: f.Add below and
// testdata/fuzz/FuzzCheckShapeAndID.
func FuzzCheckShapeAndID(f *testing.F) {
	f.Add(jwt(`{"jti":"x"}`))
	f.Add("a.b.c")
	f.Add("")
	f.Add("..")
	f.Fuzz(func(t *testing.T, s string) {
		err := CheckShape(s)
		if err != nil && len(s) > 0 && strings.Contains(err.Error(), s) && len(s) > 3 {
			t.Fatalf("error %q repeats the token", err)
		}
		if err == nil {
			parts := strings.Split(s, ".")
			if len(parts) != 3 || parts[0] == "" || parts[1] == "" {
				t.Fatalf("accepted a token of segments %q", parts)
			}
			if len(s) > MaxLength || len(s) > 16<<10 {
				t.Fatalf("accepted a token of %d bytes", len(s))
			}
		}
		_, _ = Expiry(s)
		id := ID(s)
		if id == "" {
			t.Fatal("empty id")
		}
		c, perr := ParseClaims(s)
		if perr == nil && IDOf(c, s) != id {
			t.Fatalf("IDOf %q is not ID %q", IDOf(c, s), id)
		}
		if jti, ok := strings.CutPrefix(id, "JTI="); ok {
			if perr != nil || jti != c.ID || len(jti) > 128 {
				t.Fatalf("id %q is not the token's jti claim", id)
			}
		} else if id != Fingerprint(s) {
			t.Fatalf("id %q is neither JTI=<jti> nor the fingerprint", id)
		}
		// The signature is what makes a token usable; its name must not
		// carry it. (A jti claim may repeat it: the token's author chose
		// that, and put it in the payload.)
		if i := strings.LastIndexByte(s, '.'); err == nil && i >= 0 {
			if sig := s[i+1:]; len(sig) > len(Fingerprint("")) && !strings.Contains(c.ID, sig) && strings.Contains(id, sig) {
				t.Fatalf("id %q contains the signature segment", id)
			}
		}
	})
}

func ExampleID() {
	// The payload of this ServiceAccount token is {"jti":"b1f3"}.
	tok := "eyJhbGciOiJSUzI1NiJ9.eyJqdGkiOiJiMWYzIn0.c2ln"
	fmt.Println(CheckShape(tok))
	fmt.Println(ID(tok))
	// Output:
	// <nil>
	// JTI=b1f3
}
