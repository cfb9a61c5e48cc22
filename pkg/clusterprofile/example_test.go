package clusterprofile_test

import (
	"fmt"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"

	"github.com/credbroker/credbroker/pkg/clusterprofile"
)

func ExampleAgentID() {
	td := spiffeid.RequireTrustDomainFromString("fleet.example")

	east := &v1alpha1.ClusterProfile{ObjectMeta: metav1.ObjectMeta{Namespace: "fleet", Name: "east-1"}}
	id, err := clusterprofile.AgentID(td, east)
	fmt.Println(id, err)

	west := &v1alpha1.ClusterProfile{ObjectMeta: metav1.ObjectMeta{
		Namespace: "fleet",
		Name:      "west-1",
		Annotations: map[string]string{
			clusterprofile.AgentSPIFFEIDAnnotation: "spiffe://fleet.example/ns/agents/sa/west",
		},
	}}
	id, err = clusterprofile.AgentID(td, west)
	fmt.Println(id, err)

	west.Annotations[clusterprofile.AgentSPIFFEIDAnnotation] = "spiffe://other.example/west"
	_, err = clusterprofile.AgentID(td, west)
	fmt.Println(err)
	// Output:
	// spiffe://fleet.example/clusterprofile/fleet/east-1 <nil>
	// spiffe://fleet.example/ns/agents/sa/west <nil>
	// clusterprofile fleet/west-1: annotation credbroker.io/agent-spiffe-id="spiffe://other.example/west" is outside trust domain fleet.example: invalid argument
}
