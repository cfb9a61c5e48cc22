package token

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParseClaims(t *testing.T) {
	tests := []struct {
		name    string
		token   string
		want    Claims
		wantErr string
	}{
		{
			name:  "service account token",
			token: jwt(`{"aud":["https://kubernetes.default.svc"],"exp":2000000000,"iat":1999996400,"iss":"https://spoke","jti":"5b3d","sub":"system:serviceaccount:ns:sa"}`),
			want:  Claims{Subject: "system:serviceaccount:ns:sa", Audiences: []string{"https://kubernetes.default.svc"}, Expiry: time.Unix(2000000000, 0), ID: "5b3d"},
		},
		{name: "aud as a string", token: jwt(`{"aud":"a"}`), want: Claims{Audiences: []string{"a"}}},
		{name: "empty aud array", token: jwt(`{"aud":[]}`), want: Claims{Audiences: []string{}}},
		{name: "no claims", token: jwt(`{}`)},
		{name: "null claims", token: jwt(`{"sub":null,"aud":null,"exp":null,"jti":null}`)},
		{name: "whitespace", token: jwt(" \n{ \"exp\" : 5 }"), want: Claims{Expiry: time.Unix(5, 0)}},
		{name: "not a jwt", token: "opaque", wantErr: "bearer token is not a JWT: 1 segments, want 3"},
		{name: "payload not base64", token: "e30.e30=.", wantErr: "bearer token is not a JWT: segment 2 is not base64url"},
		{name: "payload of impossible length", token: "e30.e.", wantErr: "bearer token is not a JWT: the payload is not base64url"},
		{name: "payload not json", token: jwt(`not json`), wantErr: "token claims are malformed: the payload is not a JSON object"},
		{name: "payload an array", token: jwt(`[1]`), wantErr: "token claims are malformed: the payload is not a JSON object"},
		{name: "payload null", token: jwt(`null`), wantErr: "token claims are malformed: the payload is not a JSON object"},
		{name: "truncated object", token: jwt(`{"sub":"a"`), wantErr: "token claims are malformed: the payload is not a JSON object"},
		{name: "sub a number", token: jwt(`{"sub":5}`), wantErr: "token claims are malformed: sub is not a string"},
		{name: "jti an object", token: jwt(`{"jti":{}}`), wantErr: "token claims are malformed: jti is not a string"},
		{name: "aud numbers", token: jwt(`{"aud":[1]}`), wantErr: "token claims are malformed: aud is neither a string nor an array of strings"},
		{name: "exp a string", token: jwt(`{"exp":"2000000000"}`), wantErr: "token claims are malformed: exp is not a whole number of seconds between 1970 and 9999"},
		{name: "exp a fraction", token: jwt(`{"exp":2000000000.5}`), wantErr: "token claims are malformed: exp is not a whole number of seconds between 1970 and 9999"},
		{name: "exp in exponent form", token: jwt(`{"exp":2e9}`), wantErr: "token claims are malformed: exp is not a whole number of seconds between 1970 and 9999"},
		{name: "exp zero", token: jwt(`{"exp":0}`), wantErr: "token claims are malformed: exp is not a whole number of seconds between 1970 and 9999"},
		{name: "exp negative", token: jwt(`{"exp":-1}`), wantErr: "token claims are malformed: exp is not a whole number of seconds between 1970 and 9999"},
		{name: "exp past year 9999", token: jwt(`{"exp":253402300800}`), wantErr: "token claims are malformed: exp is not a whole number of seconds between 1970 and 9999"},
		{name: "exp overflows", token: jwt(`{"exp":99999999999999999999}`), wantErr: "token claims are malformed: exp is not a whole number of seconds between 1970 and 9999"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseClaims(tt.token)
			if tt.wantErr != "" {
				require.EqualError(t, err, tt.wantErr)
				assert.Equal(t, Claims{}, got)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want.Subject, got.Subject)
			assert.Equal(t, tt.want.Audiences, got.Audiences)
			assert.True(t, tt.want.Expiry.Equal(got.Expiry), "got %v", got.Expiry)
			assert.Equal(t, tt.want.ID, got.ID)
		})
	}
}

func TestParseClaimsErrorKinds(t *testing.T) {
	_, err := ParseClaims("a.b")
	assert.ErrorIs(t, err, ErrMalformed)
	_, err = ParseClaims(jwt(`{"exp":"soon"}`))
	assert.ErrorIs(t, err, ErrMalformedClaims)
	assert.NotErrorIs(t, err, ErrMalformed)
}

func FuzzParseClaims(f *testing.F) {
	f.Add(jwt(`{"aud":["a","b"],"exp":2000000000,"jti":"x","sub":"system:serviceaccount:ns:sa"}`))
	f.Add(jwt(`{"aud":"a","exp":1}`))
	f.Add(jwt(`{"exp":1.5}`))
	f.Add(jwt(`[]`))
	f.Add("e30.e30.")
	f.Add("..")
	f.Fuzz(func(t *testing.T, s string) {
		c, err := ParseClaims(s)
		if err != nil {
			if len(s) > 3 && strings.Contains(err.Error(), s) {
				t.Fatalf("error %q repeats the token", err)
			}
			if c.Subject != "" || c.Audiences != nil || !c.Expiry.IsZero() || c.ID != "" {
				t.Fatalf("claims %+v returned with error %v", c, err)
			}
			return
		}
		if !c.Expiry.IsZero() && (c.Expiry.Unix() <= 0 || c.Expiry.Year() > 9999) {
			t.Fatalf("exp %v out of range", c.Expiry)
		}
		if CheckShape(s) != nil {
			t.Fatal("claims parsed from a token that is not JWT-shaped")
		}
	})
}
