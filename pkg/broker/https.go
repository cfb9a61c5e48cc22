package broker

import (
	"fmt"
	"net/url"
	"strings"

	"github.com/credbroker/credbroker/pkg/errdefs"
)

// checkHTTPS refuses a ClusterProfile server that is not an https URL:
// client-go sends the bearer token whatever the scheme, so to an http
// server the token would travel in cleartext. The error, wrapping
// errdefs.ErrFailedPrecondition, names the ClusterProfile, the server
// (without a password) and the access provider to fix.
func checkHTTPS(namespace, name, provider, server string) error {
	u, err := url.Parse(server)
	if err == nil && strings.EqualFold(u.Scheme, "https") && u.Opaque == "" && u.Host != "" {
		return nil
	}
	shown := server
	switch {
	case err == nil && u.User != nil:
		shown = u.Redacted()
	case err != nil && strings.Contains(server, "@"):
		shown = "(a URL with user information)"
	}
	return fmt.Errorf("ClusterProfile %s/%s has the server %q, which is not an https URL, so a token sent there would travel "+
		"in cleartext: its cluster manager must set status.accessProviders[name=%s].cluster.server to the spoke API "+
		"server's https URL: %w", namespace, name, shown, provider, errdefs.ErrFailedPrecondition)
}
