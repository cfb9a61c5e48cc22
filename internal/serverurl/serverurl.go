package serverurl

import (
	"errors"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
)

// ErrNotHTTPS is the reason Check gives for a URL whose scheme is not
// https (case aside): client-go sends the bearer token whatever the
// scheme, so over http it would travel in cleartext.
var ErrNotHTTPS = errors.New("it is not an https URL")

// Check returns nil when raw is an API server URL a token may be sent to:
// an absolute URL with the https scheme (case aside) and a host (a DNS name
// in ASCII or an IP address without an IPv6 zone), an optional port from 1
// to 65535, an optional path, and no user information, query or fragment
// (an API server URL has none of them). Otherwise the error names the
// first reason, and quotes nothing of raw.
func Check(raw string) error {
	if raw == "" {
		return errors.New("the URL is empty")
	}
	u, err := url.Parse(raw)
	if err != nil {
		return errors.New("it is not a URL")
	}
	// url.Parse puts the scheme in lower case.
	if u.Scheme != "https" || u.Opaque != "" {
		return ErrNotHTTPS
	}
	if u.User != nil {
		return errors.New("it has user information")
	}
	if u.RawQuery != "" || u.ForceQuery {
		return errors.New("it has a query")
	}
	if u.Fragment != "" || strings.Contains(raw, "#") {
		return errors.New("it has a fragment")
	}
	host, port := u.Hostname(), u.Port()
	if host == "" {
		return errors.New("it has no host")
	}
	if strings.HasSuffix(u.Host, ":") {
		return errors.New("it has an empty port")
	}
	if port != "" {
		if n, err := strconv.ParseUint(port, 10, 16); err != nil || n == 0 {
			return errors.New("it has an invalid port")
		}
	}
	// url.Parse has checked that a bracketed host is an IPv6 address.
	if addr, err := netip.ParseAddr(host); err == nil {
		if addr.Zone() != "" {
			return errors.New("it has an IPv6 zone")
		}
	} else if strings.IndexFunc(host, notHostRune) >= 0 {
		return errors.New("its host is neither an IP address nor a DNS name in ASCII")
	}
	return nil
}

// Valid reports whether Check accepts raw.
func Valid(raw string) bool {
	return Check(raw) == nil
}

// Redacted is raw as an error or a log line may show it: with the password
// of its user information replaced, or, when an "@" is elsewhere (raw does
// not parse, or the "@" is in the path, query or fragment, where a
// password may hide too), a description instead of raw.
func Redacted(raw string) string {
	if u, err := url.Parse(raw); err == nil && u.User != nil {
		return u.Redacted()
	}
	if strings.Contains(raw, "@") {
		return "(a URL with user information)"
	}
	return raw
}

// notHostRune reports whether r cannot appear in a DNS name.
func notHostRune(r rune) bool {
	return !('a' <= r && r <= 'z' || 'A' <= r && r <= 'Z' || '0' <= r && r <= '9' || r == '-' || r == '.' || r == '_')
}
