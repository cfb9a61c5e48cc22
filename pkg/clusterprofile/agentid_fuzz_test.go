package clusterprofile_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"

	"github.com/credbroker/credbroker/pkg/clusterprofile"
	"github.com/credbroker/credbroker/pkg/errdefs"
)

// FuzzAgentID maps arbitrary ClusterProfiles to agent SPIFFE IDs. An
// accepted ID is in the trust domain, names an agent, and lies under the
// reserved /clusterprofile/ path only if it is the profile's own default;
// a refusal is InvalidArgument.
func FuzzAgentID(f *testing.F) {
	f.Add("fleet", "prod", false, "")
	f.Add("fleet", "prod", true, "spiffe://fleet.example/clusterprofile/fleet/other")
	f.Add("fleet", "prod", true, "spiffe://fleet.example/clusterprofile/fleet/prod")
	f.Add("fleet", "prod", true, "spiffe://evil.example/agent")
	f.Add("fleet", "prod", true, "spiffe://fleet.example")
	f.Add("a/b", "..", true, "")
	f.Add("fleet", "prod", true, "spiffe://fleet.example/clusterprofile")
	f.Fuzz(func(t *testing.T, namespace, name string, annotated bool, annotation string) {
		cp := &v1alpha1.ClusterProfile{ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name}}
		if annotated {
			cp.Annotations = map[string]string{clusterprofile.AgentSPIFFEIDAnnotation: annotation}
		}
		id, err := clusterprofile.AgentID(td, cp)
		if err != nil {
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Fatalf("refusal %v is not InvalidArgument", err)
			}
			return
		}
		if !id.MemberOf(td) || id.Path() == "" {
			t.Fatalf("accepted %s: outside %s or without a path", id, td)
		}
		def, defErr := spiffeid.FromSegments(td, "clusterprofile", namespace, name)
		if strings.HasPrefix(id.Path()+"/", "/clusterprofile/") && (defErr != nil || id != def) {
			t.Fatalf("accepted %s under the reserved path for %s/%s", id, namespace, name)
		}
	})
}
