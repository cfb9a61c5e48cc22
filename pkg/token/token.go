package token

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"
)

// MaxLength is the longest bearer token accepted, in bytes. Kubernetes
// ServiceAccount tokens are around 1 KiB.
const MaxLength = 16 << 10

// MinExpiration is the shortest lifetime the TokenRequest API grants; every
// bound on a minted token's lifetime starts here.
const MinExpiration = 10 * time.Minute

// ErrMalformed is wrapped by every error of CheckShape.
var ErrMalformed = errors.New("bearer token is not a JWT")

// CheckShape returns an error wrapping ErrMalformed when s cannot be a JWS
// compact serialization: empty, longer than MaxLength, not three dot-separated
// segments, or segments that are not unpadded base64url. The error never
// contains s.
func CheckShape(s string) error {
	if s == "" {
		return fmt.Errorf("%w: empty", ErrMalformed)
	}
	if len(s) > MaxLength {
		return fmt.Errorf("%w: %d bytes is longer than %d", ErrMalformed, len(s), MaxLength)
	}
	if n := strings.Count(s, ".") + 1; n != 3 {
		return fmt.Errorf("%w: %d segments, want 3", ErrMalformed, n)
	}
	rest := s
	for i := range 3 {
		var p string
		p, rest, _ = strings.Cut(rest, ".")
		if p == "" && i != 2 {
			return fmt.Errorf("%w: segment %d is empty", ErrMalformed, i+1)
		}
		if strings.IndexFunc(p, notBase64URL) >= 0 {
			return fmt.Errorf("%w: segment %d is not base64url", ErrMalformed, i+1)
		}
	}
	return nil
}

func notBase64URL(r rune) bool {
	return !(r >= 'A' && r <= 'Z' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '-' || r == '_')
}

// Fingerprint is a short, stable, non-reversible name for a token, for logs.
func Fingerprint(s string) string {
	return string(appendFingerprint(make([]byte, 0, len("sha256:")+16), s))
}

// appendFingerprint appends the Fingerprint of s to dst.
func appendFingerprint(dst []byte, s string) []byte {
	sum := sha256.Sum256([]byte(s))
	return hex.AppendEncode(append(dst, "sha256:"...), sum[:8])
}

// payload returns the decoded payload segment of a JWT-shaped token.
func payload(s string) ([]byte, error) {
	if err := CheckShape(s); err != nil {
		return nil, err
	}
	raw, err := base64.RawURLEncoding.DecodeString(s[strings.IndexByte(s, '.')+1 : strings.LastIndexByte(s, '.')])
	if err != nil {
		return nil, fmt.Errorf("%w: the payload is not base64url", ErrMalformed)
	}
	return raw, nil
}

// Expiry returns the token's exp claim, unverified, as ParseClaims reads
// it; ok is false when the token has no exp or its claims are malformed.
// Use it only to shorten how long a decision about an accepted token is
// cached, never to accept one.
func Expiry(s string) (exp time.Time, ok bool) {
	c, err := ParseClaims(s)
	if err != nil || c.Expiry.IsZero() {
		return time.Time{}, false
	}
	return c.Expiry, true
}

// ID returns the token's credential id as the Kubernetes audit log records it
// ("JTI=<jti>") when the token carries a jti claim of at most 128 printable
// ASCII characters without spaces (Kubernetes writes a UUID), and its
// Fingerprint otherwise, including when its claims are malformed (see
// ParseClaims). It reads the claims without verifying them: use it only to
// name a token that an API server has issued or accepted, or whose claims
// have been checked.
func ID(s string) string {
	c, err := ParseClaims(s)
	if err != nil {
		return Fingerprint(s)
	}
	return IDOf(c, s)
}

// IDOf is ID for a caller that has already parsed s: c must be what
// ParseClaims(s) returned.
func IDOf(c Claims, s string) string {
	if c.ID != "" && len(c.ID) <= 128 && !strings.ContainsFunc(c.ID, notVisibleASCII) {
		return "JTI=" + c.ID
	}
	return Fingerprint(s)
}

func notVisibleASCII(r rune) bool { return r <= ' ' || r > '~' }
