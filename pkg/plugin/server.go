package plugin

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"strconv"
	"strings"

	clientauthenticationv1 "k8s.io/client-go/pkg/apis/clientauthentication/v1"

	"github.com/credbroker/credbroker/pkg/errdefs"
)

// canonicalServer returns the canonical form of an API server URL, so that
// two spellings of one server compare equal: the scheme and the host in
// lower case, an IP address in its canonical form without brackets, the
// port always present (443 when absent), and
// the path without trailing slashes ("" for none or "/"). The path is
// otherwise kept as it is, case and escapes included, since a path can lead
// to another cluster behind one proxy. A URL with a user, a query or a
// fragment is refused, and so is an IPv6 zone: an API server URL has none of
// them, and none is compared. So is a URL that is not https: client-go sends
// the bearer token whatever the scheme, so over http it travels in
// cleartext.
//
// The result is "https://<host>:<port><path>", with an IPv6 host in
// brackets. Errors quote no user information.
func canonicalServer(raw string) (string, error) {
	if raw == "" {
		return "", errors.New("the URL is empty")
	}
	u, err := url.Parse(raw)
	if err != nil {
		return "", errors.New("it is not a URL")
	}
	scheme := strings.ToLower(u.Scheme)
	const defaultPort = "443"
	if scheme != "https" || u.Opaque != "" {
		return "", errNotHTTPS
	}
	if u.User != nil {
		return "", errors.New("it has user information")
	}
	if u.RawQuery != "" || u.ForceQuery {
		return "", errors.New("it has a query")
	}
	if u.Fragment != "" || strings.Contains(raw, "#") {
		return "", errors.New("it has a fragment")
	}

	host, port := u.Hostname(), u.Port()
	if host == "" {
		return "", errors.New("it has no host")
	}
	if strings.HasSuffix(u.Host, ":") {
		return "", errors.New("it has an empty port")
	}
	if port == "" {
		port = defaultPort
	}
	n, err := strconv.ParseUint(port, 10, 16)
	if err != nil || n == 0 {
		return "", errors.New("it has an invalid port")
	}
	// url.Parse has checked that a bracketed host is an IPv6 address.
	if addr, err := netip.ParseAddr(host); err == nil {
		if addr.Zone() != "" {
			return "", errors.New("it has an IPv6 zone")
		}
		host = addr.String()
	} else if strings.IndexFunc(host, notHostRune) >= 0 {
		return "", errors.New("its host is neither an IP address nor a DNS name in ASCII")
	} else {
		host = strings.ToLower(host)
	}

	path := strings.TrimRight(u.EscapedPath(), "/")
	return scheme + "://" + net.JoinHostPort(host, strconv.FormatUint(n, 10)) + path, nil
}

// errNotHTTPS is the reason canonicalServer gives for a URL that is not
// https.
var errNotHTTPS = errors.New("it is not an https URL")

// isHTTPS reports whether raw is a URL with the https scheme, case aside.
func isHTTPS(raw string) bool {
	u, err := url.Parse(raw)
	return err == nil && strings.EqualFold(u.Scheme, "https") && u.Opaque == ""
}

// notHostRune reports whether r cannot appear in a DNS name.
func notHostRune(r rune) bool {
	return !('a' <= r && r <= 'z' || 'A' <= r && r <= 'Z' || '0' <= r && r <= '9' || r == '-' || r == '.' || r == '_')
}

// displayServer is raw as an error message may show it: without user
// information, which may hold a password.
func displayServer(raw string) string {
	if u, err := url.Parse(raw); err == nil && u.User != nil {
		return u.Redacted()
	}
	if strings.Contains(raw, "@") {
		return "(a URL with user information)"
	}
	return raw
}

// sameServer reports whether the ExecCredential's server, where client-go
// will send the token, is the ClusterProfile's server that the broker
// answered, returning an error that names both otherwise.
func sameServer(cluster Reference, execServer, brokerServer string) error {
	if brokerServer == "" {
		return fmt.Errorf("exchange for cluster %s: the broker returned no server for it, so the token's destination "+
			"%s cannot be checked; refusing the token: %w", cluster, displayServer(execServer), errdefs.ErrPermissionDenied)
	}
	want, err := canonicalServer(brokerServer)
	if err != nil {
		return fmt.Errorf("exchange for cluster %s: its server %q, from the broker, is unusable: %v; refusing the token: %w",
			cluster, displayServer(brokerServer), err, errdefs.ErrPermissionDenied)
	}
	got, err := canonicalServer(execServer)
	if err != nil {
		return fmt.Errorf("exchange for cluster %s: the exec info's server %q is unusable: %v; refusing the token: %w",
			cluster, displayServer(execServer), err, errdefs.ErrPermissionDenied)
	}
	if got != want {
		return fmt.Errorf("exchange for cluster %s: refusing to hand its token to %s (ExecCredential spec.cluster.server): "+
			"the cluster's server is %s; the access provider that runs this plugin names ClusterProfile %s "+
			"in its exec config but points at another server: %w",
			cluster, displayServer(execServer), displayServer(brokerServer), cluster, errdefs.ErrPermissionDenied)
	}
	return nil
}

// checkTransport refuses, before any token is asked for, exec info whose
// client would send the token to the server by a path the broker cannot
// vouch for: without TLS (a server that is not https), without verifying
// the server's certificate, through a proxy, or verifying it for another
// name than the server's host. It names every such setting.
func checkTransport(cluster Reference, c *clientauthenticationv1.Cluster) error {
	var problems []string
	if !isHTTPS(c.Server) {
		problems = append(problems, fmt.Sprintf("the server %s is not an https URL, so the client would send the token "+
			"in cleartext", displayServer(c.Server)))
	}
	if c.InsecureSkipTLSVerify {
		problems = append(problems, "insecure-skip-tls-verify is true, so the client would not verify the server it sends the token to")
	}
	if c.ProxyURL != "" {
		problems = append(problems, fmt.Sprintf("proxy-url is %s, so the client would send the token through that proxy, "+
			"and the broker answers no proxy for the cluster to check it against: spokes behind a proxy are not supported "+
			"by the server pin yet", displayServer(c.ProxyURL)))
	}
	if c.TLSServerName != "" && !isHost(c.Server, c.TLSServerName) {
		problems = append(problems, fmt.Sprintf("tls-server-name is %q, so the client would accept a certificate for that name "+
			"instead of the server's host, and the broker answers no TLS server name for the cluster to check it against",
			c.TLSServerName))
	}
	if len(problems) == 0 {
		return nil
	}
	return fmt.Errorf("exchange for cluster %s: refusing to ask for a token for %s: in ExecCredential spec.cluster, %s; "+
		"the access provider that runs this plugin must give the cluster's server and CA only: %w",
		cluster, displayServer(c.Server), strings.Join(problems, "; "), errdefs.ErrPermissionDenied)
}

// isHost reports whether name is the host of the URL server, as the TLS
// client would verify it without a tls-server-name: case aside, and an IP
// address in any spelling.
func isHost(server, name string) bool {
	u, err := url.Parse(server)
	if err != nil {
		return false
	}
	host := u.Hostname()
	if a, err := netip.ParseAddr(host); err == nil {
		b, err := netip.ParseAddr(name)
		return err == nil && a == b
	}
	return host != "" && strings.EqualFold(host, name)
}

// sameCA reports whether the ExecCredential's CA bundle, the one client-go
// will verify the server with, is the ClusterProfile's bundle that the
// broker answered, surrounding white space aside; both empty (the system
// roots) is the same. The error names both bundles by size and SHA-256,
// never by content.
func sameCA(cluster Reference, execServer string, execCA, brokerCA []byte) error {
	got, want := bytes.TrimSpace(execCA), bytes.TrimSpace(brokerCA)
	if bytes.Equal(got, want) {
		return nil
	}
	return fmt.Errorf("exchange for cluster %s: refusing to hand its token to %s: the CA bundle that would verify it "+
		"(ExecCredential spec.cluster.certificate-authority-data) is %s, and the cluster's is %s; the access provider "+
		"that runs this plugin names ClusterProfile %s in its exec config but trusts another CA: %w",
		cluster, displayServer(execServer), describeCA(got), describeCA(want), cluster, errdefs.ErrPermissionDenied)
}

// describeCA names a CA bundle in an error without quoting it.
func describeCA(b []byte) string {
	if len(b) == 0 {
		return "none (the system roots)"
	}
	return fmt.Sprintf("%d bytes with SHA-256 %x", len(b), sha256.Sum256(b))
}
