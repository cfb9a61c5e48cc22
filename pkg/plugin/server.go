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

	"github.com/credbroker/credbroker/internal/serverurl"
	"github.com/credbroker/credbroker/pkg/errdefs"
)

// canonicalServer returns the canonical form of an API server URL, so that
// two spellings of one server compare equal: the scheme and the host in
// lower case, an IP address in its canonical form without brackets, the
// port always present (443 when absent), and
// the path without trailing slashes ("" for none or "/"). The path is
// otherwise kept as it is, case and escapes included, since a path can lead
// to another cluster behind one proxy. A URL that serverurl.Check refuses
// (the rule the broker serves and the publisher pins a server by) is
// refused: one with a user, a query, a fragment or an IPv6 zone, since an
// API server URL has none of them and none is compared, or one that is not
// https, since client-go sends the bearer token whatever the scheme, so
// over http it travels in cleartext.
//
// The result is "https://<host>:<port><path>", with an IPv6 host in
// brackets. Errors quote no user information.
func canonicalServer(raw string) (string, error) {
	if err := serverurl.Check(raw); err != nil {
		return "", err
	}
	// Check has parsed raw, and checked its host and port.
	u, _ := url.Parse(raw)
	host, port := u.Hostname(), u.Port()
	if port == "" {
		port = "443"
	}
	n, _ := strconv.ParseUint(port, 10, 16)
	if addr, err := netip.ParseAddr(host); err == nil {
		host = addr.String()
	} else {
		host = strings.ToLower(host)
	}
	path := strings.TrimRight(u.EscapedPath(), "/")
	return "https://" + net.JoinHostPort(host, strconv.FormatUint(n, 10)) + path, nil
}

// displayServer is raw as an error message may show it: without user
// information, which may hold a password.
func displayServer(raw string) string {
	return serverurl.Redacted(raw)
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
	switch err := serverurl.Check(c.Server); {
	case errors.Is(err, serverurl.ErrNotHTTPS):
		problems = append(problems, fmt.Sprintf("the server %s is not an https URL, so the client would send the token "+
			"in cleartext", displayServer(c.Server)))
	case err != nil:
		problems = append(problems, fmt.Sprintf("the server %s is not a usable API server URL: %v", displayServer(c.Server), err))
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
