// Package token holds the few things credbroker does with a bearer token
// without trusting it: a cheap shape check before a TokenReview, safe names
// for a token in logs and audit lines, and ParseClaims, which reads the sub,
// aud, exp and jti claims so that a caller can check them against what it
// asked for.
//
// Nothing here verifies a signature; the API server that issued a token is
// the only judge of it. Never log a token: log Fingerprint or ID instead.
package token
