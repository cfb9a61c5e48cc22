package fleet

import (
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"k8s.io/apimachinery/pkg/types"
)

// ClusterRef names one incarnation of a ClusterProfile: a profile deleted and
// recreated under the same name has a new UID, and the sessions admitted for
// the old one do not serve the new one.
type ClusterRef struct {
	types.NamespacedName
	UID types.UID
}

func (c ClusterRef) String() string { return c.NamespacedName.String() }

// agentIDSegment is the first path segment of every ClusterProfile's
// default agent ID.
const agentIDSegment = "clusterprofile"

// AgentIDPathPrefix is the path under which every ClusterProfile's default
// agent ID lives: spiffe://<td>/clusterprofile/<namespace>/<name>.
const AgentIDPathPrefix = "/" + agentIDSegment + "/"

// AgentID returns the default SPIFFE ID of the agent that serves the
// ClusterProfile cluster: spiffe://<td>/clusterprofile/<namespace>/<name>.
// It fails when the namespace or the name is not a SPIFFE ID path segment.
func AgentID(td spiffeid.TrustDomain, cluster types.NamespacedName) (spiffeid.ID, error) {
	return spiffeid.FromSegments(td, agentIDSegment, cluster.Namespace, cluster.Name)
}

// BrokerID returns the broker's default SPIFFE ID, spiffe://<td>/broker.
func BrokerID(td spiffeid.TrustDomain) spiffeid.ID {
	return spiffeid.RequireFromPath(td, "/broker")
}
