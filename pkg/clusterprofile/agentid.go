package clusterprofile

import (
	"errors"
	"fmt"
	"strings"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"

	"github.com/credbroker/credbroker/pkg/errdefs"
)

// AgentSPIFFEIDAnnotation, on a ClusterProfile, names the SPIFFE ID of the
// agent that serves it, replacing the default ID.
const AgentSPIFFEIDAnnotation = "credbroker.io/agent-spiffe-id"

// reservedPath is the path under which every ClusterProfile's default agent
// ID lives. An annotation may name an ID under it only when that ID is the
// profile's own default, so no profile can claim another profile's agent.
const reservedPath = "/clusterprofile/"

// AgentID is the SPIFFE ID an agent must present to serve cp.
//
// When cp has the annotation AgentSPIFFEIDAnnotation, its value is the ID; it
// must parse, have a path and be in td, and it must not lie under the
// reserved path /clusterprofile/ unless it is cp's own default ID, or AgentID
// returns an error wrapping errdefs.ErrInvalidArgument. An annotation that is
// present but empty is an error too, never a fallback to the default.
// Without the annotation the ID is
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
	def, defErr := spiffeid.FromSegments(td, "clusterprofile", cp.Namespace, cp.Name)
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
	case strings.HasPrefix(id.Path()+"/", reservedPath) && (defErr != nil || id != def):
		return spiffeid.ID{}, fmt.Errorf("clusterprofile %s/%s: annotation %s=%q lies under the reserved path %s, "+
			"where each ClusterProfile owns only its own default ID; choose an ID outside it",
			cp.Namespace, cp.Name, AgentSPIFFEIDAnnotation, v, reservedPath)
	}
	return id, nil
}
