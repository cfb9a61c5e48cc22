package broker

import (
	"errors"
	"fmt"

	"github.com/credbroker/credbroker/internal/serverurl"
	"github.com/credbroker/credbroker/pkg/errdefs"
)

// checkHTTPS refuses a ClusterProfile server that serverurl.Check refuses,
// the rule the publisher pins an entry by: client-go sends the bearer token
// whatever the scheme, so to an http server the token would travel in
// cleartext, and an API server URL has a host and no user information,
// query or fragment. The error, wrapping errdefs.ErrFailedPrecondition,
// names the ClusterProfile, the server (without a password), why it is
// refused and the access provider to fix.
func checkHTTPS(namespace, name, provider, server string) error {
	err := serverurl.Check(server)
	if err == nil {
		return nil
	}
	why := "which is not an https URL, so a token sent there would travel in cleartext"
	if !errors.Is(err, serverurl.ErrNotHTTPS) {
		why = fmt.Sprintf("which is not a usable API server URL (%v)", err)
	}
	return fmt.Errorf("ClusterProfile %s/%s has the server %q, %s: its cluster manager must set "+
		"status.accessProviders[name=%s].cluster.server to the spoke API server's https URL, with a host and without "+
		"user information, query or fragment: %w", namespace, name, serverurl.Redacted(server), why, provider,
		errdefs.ErrFailedPrecondition)
}
