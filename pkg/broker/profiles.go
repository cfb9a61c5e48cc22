package broker

import (
	"fmt"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"k8s.io/apimachinery/pkg/types"

	"github.com/credbroker/credbroker/pkg/clusterprofile"
	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/tokenexchange"
)

// agentResolver admits agents through the ClusterProfile index.
type agentResolver struct{ profiles *clusterprofile.Index }

func (r agentResolver) ResolveAgent(id spiffeid.ID) (fleet.ClusterRef, error) {
	cp, err := r.profiles.ForAgent(id)
	if err != nil {
		return fleet.ClusterRef{}, err
	}
	return fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: cp.Namespace, Name: cp.Name}, UID: cp.UID}, nil
}

// clusterLookup answers the exchange's ClusterProfile lookups.
type clusterLookup struct {
	profiles *clusterprofile.Index
	provider string
}

func (c clusterLookup) Cluster(namespace, name string) (tokenexchange.Cluster, error) {
	cp, err := c.profiles.Shared(namespace, name) // read here, never kept
	if err != nil {
		return tokenexchange.Cluster{}, err
	}
	if err := c.profiles.CheckAgent(cp); err != nil {
		return tokenexchange.Cluster{}, err
	}
	server, ca, ok := clusterprofile.Access(cp, c.provider)
	if !ok {
		// Never answer an empty server: the plugin checks that the token
		// goes to this cluster's server, and could not check against none.
		return tokenexchange.Cluster{}, fmt.Errorf("ClusterProfile %s/%s has no server: neither its access provider %q nor any other "+
			"in its status has a cluster.server; its cluster manager must set status.accessProviders[name=%s].cluster.server: %w",
			namespace, name, c.provider, c.provider, errdefs.ErrFailedPrecondition)
	}
	if err := checkHTTPS(namespace, name, c.provider, server); err != nil {
		return tokenexchange.Cluster{}, err
	}
	return tokenexchange.Cluster{
		Ref:    fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: namespace, Name: name}, UID: cp.UID},
		Server: server,
		CAData: ca,
	}, nil
}
