package fleet_test

import (
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/types"

	"github.com/credbroker/credbroker/pkg/fleet"
)

func TestAgentID(t *testing.T) {
	td := spiffeid.RequireTrustDomainFromString("fleet.example")
	tests := []struct {
		name    string
		cluster types.NamespacedName
		want    string
		wantErr bool
	}{
		{name: "namespace and name", cluster: types.NamespacedName{Namespace: "fleet", Name: "prod-eu-1"}, want: "spiffe://fleet.example/clusterprofile/fleet/prod-eu-1"},
		{name: "a name with a slash", cluster: types.NamespacedName{Namespace: "fleet", Name: "a/b"}, wantErr: true},
		{name: "no namespace", cluster: types.NamespacedName{Name: "prod"}, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			id, err := fleet.AgentID(td, tt.cluster)
			if tt.wantErr {
				assert.Error(t, err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, id.String())
			assert.Equal(t, fleet.AgentIDPathPrefix+tt.cluster.Namespace+"/"+tt.cluster.Name, id.Path())
		})
	}
}

func TestBrokerID(t *testing.T) {
	assert.Equal(t, "spiffe://fleet.example/broker", fleet.BrokerID(spiffeid.RequireTrustDomainFromString("fleet.example")).String())
}

func TestClusterRefString(t *testing.T) {
	c := fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: "fleet", Name: "prod"}, UID: "uid-1"}
	assert.Equal(t, "fleet/prod", c.String(), "the UID is not part of the name")
}
