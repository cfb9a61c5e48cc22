package token

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"
)

// ErrMalformedClaims is wrapped by every error of ParseClaims about the
// payload's content; a token that is not JWT-shaped gives ErrMalformed.
var ErrMalformedClaims = errors.New("token claims are malformed")

// Claims are the registered claims (RFC 7519) that credbroker reads from a
// token it cannot verify.
type Claims struct {
	// Subject is the sub claim; empty when absent.
	Subject string
	// Audiences is the aud claim, which may be a string or an array of
	// strings; nil when absent.
	Audiences []string
	// Expiry is the exp claim; zero when absent.
	Expiry time.Time
	// ID is the jti claim; empty when absent.
	ID string
}

// ParseClaims decodes the sub, aud, exp and jti claims of a JWT-shaped token
// without verifying its signature: the caller must check them against what
// it expects, and must not treat them as proof of anything the token's
// issuer has not also been asked. Errors wrap ErrMalformed when s is not
// JWT-shaped (see CheckShape), and ErrMalformedClaims when the payload is not
// a JSON object, a claim has the wrong type, or exp is not a positive whole
// number of seconds (Kubernetes never writes a fraction). Errors never
// contain s.
func ParseClaims(s string) (Claims, error) {
	raw, err := payload(s)
	if err != nil {
		return Claims{}, err
	}
	if t := bytes.TrimLeft(raw, " \t\r\n"); len(t) == 0 || t[0] != '{' {
		return Claims{}, fmt.Errorf("%w: the payload is not a JSON object", ErrMalformedClaims)
	}
	var p struct {
		Sub json.RawMessage `json:"sub"`
		Aud json.RawMessage `json:"aud"`
		Exp json.RawMessage `json:"exp"`
		JTI json.RawMessage `json:"jti"`
	}
	if err := json.Unmarshal(raw, &p); err != nil {
		return Claims{}, fmt.Errorf("%w: the payload is not a JSON object", ErrMalformedClaims)
	}
	var c Claims
	if err := optional(p.Sub, &c.Subject); err != nil {
		return Claims{}, fmt.Errorf("%w: sub is not a string", ErrMalformedClaims)
	}
	if err := optional(p.JTI, &c.ID); err != nil {
		return Claims{}, fmt.Errorf("%w: jti is not a string", ErrMalformedClaims)
	}
	if c.Audiences, err = audiences(p.Aud); err != nil {
		return Claims{}, err
	}
	if c.Expiry, err = numericDate(p.Exp); err != nil {
		return Claims{}, err
	}
	return c, nil
}

// absent reports whether a claim is missing or null.
func absent(raw json.RawMessage) bool {
	return len(raw) == 0 || string(raw) == "null"
}

func optional(raw json.RawMessage, s *string) error {
	if absent(raw) {
		return nil
	}
	return json.Unmarshal(raw, s)
}

// audiences decodes aud, which RFC 7519 allows to be one string or an array
// of strings.
func audiences(raw json.RawMessage) ([]string, error) {
	if absent(raw) {
		return nil, nil
	}
	var one string
	if err := json.Unmarshal(raw, &one); err == nil {
		return []string{one}, nil
	}
	var many []string
	if err := json.Unmarshal(raw, &many); err != nil {
		return nil, fmt.Errorf("%w: aud is neither a string nor an array of strings", ErrMalformedClaims)
	}
	return many, nil
}

// numericDate decodes exp as a positive whole number of seconds since the
// epoch, no later than year 9999.
func numericDate(raw json.RawMessage) (time.Time, error) {
	if absent(raw) {
		return time.Time{}, nil
	}
	const maxUnix = 253402300799 // 9999-12-31T23:59:59Z
	n, err := strconv.ParseInt(string(raw), 10, 64)
	if err != nil || n <= 0 || n > maxUnix {
		return time.Time{}, fmt.Errorf("%w: exp is not a whole number of seconds between 1970 and 9999", ErrMalformedClaims)
	}
	return time.Unix(n, 0), nil
}
