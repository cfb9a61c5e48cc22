package clusterprofile

import (
	"errors"
	"fmt"
	"strings"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
)

// AgentSPIFFEIDAnnotation, on a ClusterProfile, names the SPIFFE ID of the
// agent that serves it, replacing the default ID.
const AgentSPIFFEIDAnnotation = "credbroker.io/agent-spiffe-id"

// AgentID is the SPIFFE ID an agent must present to serve cp.
//
// When cp has the annotation AgentSPIFFEIDAnnotation, its value is the ID; it
// must parse, have a path and be in td, and it must not lie under the
// reserved path fleet.AgentIDPathPrefix (/clusterprofile/), where every
// profile's default ID lives, unless it is cp's own default ID, so that no
// profile can claim another profile's agent; or AgentID returns an error
// wrapping errdefs.ErrInvalidArgument. An annotation that is present but
// empty is an error too, never a fallback to the default. Without the
// annotation the ID is the default, fleet.AgentID:
// spiffe://<td>/clusterprofile/<namespace>/<name>.
func AgentID(td spiffeid.TrustDomain, cp *v1alpha1.ClusterProfile) (spiffeid.ID, error) {
	id, err := agentID(td, cp)
	if err != nil {
		return spiffeid.ID{}, fmt.Errorf("%w: %w", err, errdefs.ErrInvalidArgument)
	}
	return id, nil
}

// agentID is AgentID with errors that wrap no sentinel, so that each caller
// says whose fault a bad ID is.
func agentID(td spiffeid.TrustDomain, cp *v1alpha1.ClusterProfile) (spiffeid.ID, error) {
	if cp == nil {
		return spiffeid.ID{}, errors.New("agent ID of a nil ClusterProfile")
	}
	if td.IsZero() {
		return spiffeid.ID{}, fmt.Errorf("agent ID of clusterprofile %s/%s: empty trust domain", cp.Namespace, cp.Name)
	}
	def, defErr := fleet.AgentID(td, types.NamespacedName{Namespace: cp.Namespace, Name: cp.Name})
	v, ok := cp.Annotations[AgentSPIFFEIDAnnotation]
	if !ok {
		if defErr != nil {
			return spiffeid.ID{}, fmt.Errorf("clusterprofile %q/%q has no default agent ID (%v)", cp.Namespace, cp.Name, defErr)
		}
		return def, nil
	}
	id, err := spiffeid.FromString(v)
	switch {
	case err != nil:
		return spiffeid.ID{}, fmt.Errorf("clusterprofile %s/%s: annotation %s=%q is not a SPIFFE ID (%v)",
			cp.Namespace, cp.Name, AgentSPIFFEIDAnnotation, v, err)
	case !id.MemberOf(td):
		return spiffeid.ID{}, fmt.Errorf("clusterprofile %s/%s: annotation %s=%q is outside trust domain %s",
			cp.Namespace, cp.Name, AgentSPIFFEIDAnnotation, v, td)
	case id.Path() == "":
		return spiffeid.ID{}, fmt.Errorf("clusterprofile %s/%s: annotation %s=%q names the trust domain, not an agent",
			cp.Namespace, cp.Name, AgentSPIFFEIDAnnotation, v)
	case strings.HasPrefix(id.Path()+"/", fleet.AgentIDPathPrefix) && (defErr != nil || id != def):
		return spiffeid.ID{}, fmt.Errorf("clusterprofile %s/%s: annotation %s=%q lies under the reserved path %s, "+
			"where each ClusterProfile owns only its own default ID; choose an ID outside it",
			cp.Namespace, cp.Name, AgentSPIFFEIDAnnotation, v, fleet.AgentIDPathPrefix)
	}
	return id, nil
}
