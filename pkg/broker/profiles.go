package broker

import (
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"k8s.io/apimachinery/pkg/types"

	"github.com/credbroker/credbroker/pkg/clusterprofile"
	"github.com/credbroker/credbroker/pkg/fleet"
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
