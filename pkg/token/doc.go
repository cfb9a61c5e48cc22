// Package token holds the few things credbroker does with a bearer token
// without trusting it: a cheap shape check before a TokenReview, and safe
// names for a token in logs and audit lines.
//
// Nothing here verifies a signature; the API server that issued a token is
// the only judge of it. Never log a token: log Fingerprint or ID instead.
package token
