package token

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
)

const (
	esHeader  = "eyJhbGciOiJFUzI1NiIsImtpZCI6IlNYUkFoR1VvUHpCWjJhZVhTcFRZOGxtczdjNUVtenlwVXk2RHBmMFZsNUkifQ"
	esPayload = "eyJhdWQiOlsiY3JlZGJyb2tlciJdLCJleHAiOjE3NjQ1MDQwMDAsInN1YiI6InN5c3RlbTpzZXJ2aWNlYWNjb3VudDphOmIifQ"
	esSig     = "o8WAo1EjuUPCx2Jw3-XrL6v1bX8GmU0d5D4rCkZqk2u6b7m8l9q0w1e2r3t4y5u6i7o8p9a0s1d2f3g4h5j6k7l8z9"
)

func TestRedact(t *testing.T) {
	jwt := esHeader + "." + esPayload + "." + esSig
	tests := []struct {
		name string
		in   string
		want string
	}{
		{name: "plain text", in: `spoke ServiceAccount ns/sa does not allow audience "https://vault.example:8200"`},
		{name: "names and ids", in: "fleet/spoke-1 spiffe://fleet.credbroker.test/clusterprofile/fleet/spoke-1 JTI=0b6c1f0e-5c1d-4b7e-9a33-2f4c1e8f9a10 " +
			"system:serviceaccount:hub-1:consumer 2f4c1e8f-9a10-4b7e-9a33-0b6c1f0e5c1d sha256:0011223344556677 spoke-1.fleet.credbroker.test:8443"},
		{name: "whole JWT", in: "token " + jwt + " end", want: "token [redacted " + Fingerprint(jwt) + "] end"},
		{name: "header", in: `audience "` + esHeader + `"`, want: `audience "[redacted ` + Fingerprint(esHeader) + `]"`},
		{name: "payload", in: esPayload, want: "[redacted " + Fingerprint(esPayload) + "]"},
		{name: "signature", in: "x=" + esSig, want: "x=[redacted " + Fingerprint(esSig) + "]"},
		{name: "header and payload", in: esHeader + "." + esPayload + ".", want: "[redacted " + Fingerprint(esHeader+"."+esPayload+".") + "]"},
		{name: "short eyJ", in: "eyJhbGci", want: "eyJhbGci"},
		{name: "hex digest below 64", in: strings.Repeat("ab", 31)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			want := tt.want
			if want == "" {
				want = tt.in
			}
			got := Redact(tt.in)
			assert.Equal(t, want, got)
			assert.Equal(t, want, string(AppendRedacted([]byte("x"), tt.in, appendAsIs))[1:], "AppendRedacted")
			for seg := range strings.SplitSeq(jwt, ".") {
				assert.NotContains(t, got, seg)
			}
		})
	}
}

func FuzzRedact(f *testing.F) {
	f.Add("token " + esHeader + "." + esPayload + "." + esSig)
	f.Add(`audience "` + esSig + `"`)
	f.Add("fleet/spoke-1")
	f.Fuzz(func(t *testing.T, s string) {
		got := Redact(s)
		assert.Equal(t, got, string(AppendRedacted(nil, s, appendAsIs)), "AppendRedacted")
		// Idempotent, and nothing token-like survives.
		assert.Equal(t, got, Redact(got))
		for i := 0; i < len(got); {
			j := i
			for j < len(got) && isRunByte(got[j]) {
				j++
			}
			if j > i {
				assert.False(t, tokenLike(got[i:j]), "%q survived in %q", got[i:j], got)
				i = j
			} else {
				i++
			}
		}
	})
}

func appendAsIs(dst []byte, s string) []byte { return append(dst, s...) }
