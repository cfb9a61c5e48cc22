package clusterprofile

import (
	"errors"
	"fmt"

	"k8s.io/apimachinery/pkg/types"

	"github.com/credbroker/credbroker/internal/serverurl"
	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
)

// Lookup answers the exchange's ClusterProfile lookups from an Index.
type Lookup struct {
	Index *Index
	// Provider is the access provider whose server is answered first
	// (Access's preferred).
	Provider string
}

// Cluster returns the ClusterProfile namespace/name as the exchange
// answers it. It fails as Get does for a missing profile, as CheckAgent
// does for one that no agent can serve, and with errdefs.ErrFailedPrecondition
// for one without a server or whose server is not a usable https URL.
func (l Lookup) Cluster(namespace, name string) (fleet.Cluster, error) {
	cp, err := l.Index.Shared(namespace, name) // read here, never kept
	if err != nil {
		return fleet.Cluster{}, err
	}
	if err := l.Index.CheckAgent(cp); err != nil {
		return fleet.Cluster{}, err
	}
	server, ca, ok := Access(cp, l.Provider)
	if !ok {
		// Never answer an empty server: the plugin checks that the token
		// goes to this cluster's server, and could not check against none.
		return fleet.Cluster{}, fmt.Errorf("ClusterProfile %s/%s has no server: neither its access provider %q nor any other "+
			"in its status has a cluster.server; its cluster manager must set status.accessProviders[name=%s].cluster.server: %w",
			namespace, name, l.Provider, l.Provider, errdefs.ErrFailedPrecondition)
	}
	if err := checkHTTPS(namespace, name, l.Provider, server); err != nil {
		return fleet.Cluster{}, err
	}
	return fleet.Cluster{
		Ref:    fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: namespace, Name: name}, UID: cp.UID},
		Server: server,
		CAData: ca,
	}, nil
}

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
