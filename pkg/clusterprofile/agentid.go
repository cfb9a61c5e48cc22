package clusterprofile

import (
	"fmt"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"

	"github.com/credbroker/credbroker/pkg/errdefs"
)

// AgentSPIFFEIDAnnotation, on a ClusterProfile, names the SPIFFE ID of the
// agent that serves it, replacing the default ID.
const AgentSPIFFEIDAnnotation = "credbroker.io/agent-spiffe-id"

// AgentID is the SPIFFE ID an agent must present to serve cp.
//
// When cp has the annotation AgentSPIFFEIDAnnotation, its value is the ID; it
// must parse, have a path and be in td, or AgentID returns an error wrapping
// errdefs.ErrInvalidArgument. An annotation that is present but empty is an
// error too, never a fallback to the default. Without the annotation the ID
// is spiffe://<td>/clusterprofile/<namespace>/<name>.
func AgentID(td spiffeid.TrustDomain, cp *v1alpha1.ClusterProfile) (spiffeid.ID, error) {
	if cp == nil {
		return spiffeid.ID{}, fmt.Errorf("agent ID of a nil ClusterProfile: %w", errdefs.ErrInvalidArgument)
	}
	if td.IsZero() {
		return spiffeid.ID{}, fmt.Errorf("agent ID of clusterprofile %s/%s: empty trust domain: %w",
			cp.Namespace, cp.Name, errdefs.ErrInvalidArgument)
	}
	if v, ok := cp.Annotations[AgentSPIFFEIDAnnotation]; ok {
		id, err := spiffeid.FromString(v)
		switch {
		case err != nil:
			return spiffeid.ID{}, fmt.Errorf("clusterprofile %s/%s: annotation %s=%q is not a SPIFFE ID (%v): %w",
				cp.Namespace, cp.Name, AgentSPIFFEIDAnnotation, v, err, errdefs.ErrInvalidArgument)
		case !id.MemberOf(td):
			return spiffeid.ID{}, fmt.Errorf("clusterprofile %s/%s: annotation %s=%q is outside trust domain %s: %w",
				cp.Namespace, cp.Name, AgentSPIFFEIDAnnotation, v, td, errdefs.ErrInvalidArgument)
		case id.Path() == "":
			return spiffeid.ID{}, fmt.Errorf("clusterprofile %s/%s: annotation %s=%q names the trust domain, not an agent: %w",
				cp.Namespace, cp.Name, AgentSPIFFEIDAnnotation, v, errdefs.ErrInvalidArgument)
		}
		return id, nil
	}
	id, err := spiffeid.FromSegments(td, "clusterprofile", cp.Namespace, cp.Name)
	if err != nil {
		return spiffeid.ID{}, fmt.Errorf("clusterprofile %q/%q has no default agent ID (%v): %w",
			cp.Namespace, cp.Name, err, errdefs.ErrInvalidArgument)
	}
	return id, nil
}
