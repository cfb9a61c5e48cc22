package clusterprofile_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"

	"github.com/credbroker/credbroker/pkg/clusterprofile"
	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
)

func withAccess(cp *v1alpha1.ClusterProfile, providers ...v1alpha1.AccessProvider) *v1alpha1.ClusterProfile {
	cp.Status.AccessProviders = providers
	return cp
}

// The exchange gets a ClusterProfile's incarnation, server and CA, or a
// refusal for one it must not answer.
func TestLookup(t *testing.T) {
	h := start(t,
		withAccess(profile("fleet", "east-1"), provider("kubeconfig", "https://other.example", ""), provider("credbroker", "https://east.example", "ca-east")),
		withAccess(profile("fleet", "other-1"), provider("kubeconfig", "https://other.example", "")),
		profile("fleet", "bare-1"),
		withAccess(profile("fleet", "plain-1"), provider("credbroker", "http://plain.example", "")),
		withAccess(profile("fleet", "bad-1", "not a spiffe id"), provider("credbroker", "https://bad.example", "")),
	)
	lookup := clusterprofile.Lookup{Index: h.idx, Provider: "credbroker"}
	tests := []struct {
		name    string
		server  string
		ca      []byte
		wantErr error
		msg     string
	}{
		{name: "east-1", server: "https://east.example", ca: []byte("ca-east")},
		{name: "other-1", server: "https://other.example"},
		{name: "bare-1", wantErr: errdefs.ErrFailedPrecondition, msg: "ClusterProfile fleet/bare-1 has no server"},
		{name: "plain-1", wantErr: errdefs.ErrFailedPrecondition, msg: "not an https URL"},
		{name: "bad-1", wantErr: errdefs.ErrFailedPrecondition},
		{name: "north-1", wantErr: errdefs.ErrNotFound, msg: "clusterprofile fleet/north-1 not found"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := lookup.Cluster("fleet", tt.name)
			if tt.wantErr != nil {
				require.ErrorIs(t, err, tt.wantErr)
				assert.Contains(t, err.Error(), tt.msg)
				return
			}
			require.NoError(t, err)
			cp, err := h.idx.Get("fleet", tt.name)
			require.NoError(t, err)
			assert.Equal(t, fleet.Cluster{
				Ref:    fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: "fleet", Name: tt.name}, UID: cp.UID},
				Server: tt.server,
				CAData: tt.ca,
			}, got)
		})
	}
}
