package clusterprofile_test

import (
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"

	"github.com/credbroker/credbroker/pkg/clusterprofile"
	"github.com/credbroker/credbroker/pkg/errdefs"
)

var td = spiffeid.RequireTrustDomainFromString("fleet.example")

func profile(ns, name string, annotation ...string) *v1alpha1.ClusterProfile {
	cp := &v1alpha1.ClusterProfile{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec:       v1alpha1.ClusterProfileSpec{ClusterManager: v1alpha1.ClusterManager{Name: "test"}},
	}
	if len(annotation) > 0 {
		cp.Annotations = map[string]string{clusterprofile.AgentSPIFFEIDAnnotation: annotation[0]}
	}
	return cp
}

func TestAgentID(t *testing.T) {
	tests := []struct {
		name    string
		td      spiffeid.TrustDomain
		cp      *v1alpha1.ClusterProfile
		want    string
		wantErr string
	}{
		{
			name: "default",
			td:   td,
			cp:   profile("fleet", "east-1"),
			want: "spiffe://fleet.example/clusterprofile/fleet/east-1",
		},
		{
			name: "dotted name",
			td:   td,
			cp:   profile("fleet", "east.prod.example"),
			want: "spiffe://fleet.example/clusterprofile/fleet/east.prod.example",
		},
		{
			name: "other annotations do not matter",
			td:   td,
			cp: func() *v1alpha1.ClusterProfile {
				cp := profile("fleet", "east-1")
				cp.Annotations = map[string]string{"example.com/owner": "team-a"}
				return cp
			}(),
			want: "spiffe://fleet.example/clusterprofile/fleet/east-1",
		},
		{
			name: "annotation",
			td:   td,
			cp:   profile("fleet", "east-1", "spiffe://fleet.example/ns/agents/sa/east"),
			want: "spiffe://fleet.example/ns/agents/sa/east",
		},
		{
			name:    "annotation in another trust domain",
			td:      td,
			cp:      profile("fleet", "east-1", "spiffe://evil.example/clusterprofile/fleet/east-1"),
			wantErr: `clusterprofile fleet/east-1: annotation credbroker.io/agent-spiffe-id="spiffe://evil.example/clusterprofile/fleet/east-1" is outside trust domain fleet.example: invalid argument`,
		},
		{
			name:    "annotation not a SPIFFE ID",
			td:      td,
			cp:      profile("fleet", "east-1", "https://fleet.example/east"),
			wantErr: `clusterprofile fleet/east-1: annotation credbroker.io/agent-spiffe-id="https://fleet.example/east" is not a SPIFFE ID (scheme is missing or invalid): invalid argument`,
		},
		{
			name:    "annotation with trailing slash",
			td:      td,
			cp:      profile("fleet", "east-1", "spiffe://fleet.example/east/"),
			wantErr: `clusterprofile fleet/east-1: annotation credbroker.io/agent-spiffe-id="spiffe://fleet.example/east/" is not a SPIFFE ID (path cannot have a trailing slash): invalid argument`,
		},
		{
			name:    "annotation empty",
			td:      td,
			cp:      profile("fleet", "east-1", ""),
			wantErr: `clusterprofile fleet/east-1: annotation credbroker.io/agent-spiffe-id="" is not a SPIFFE ID (cannot be empty): invalid argument`,
		},
		{
			name:    "annotation names the trust domain",
			td:      td,
			cp:      profile("fleet", "east-1", "spiffe://fleet.example"),
			wantErr: `clusterprofile fleet/east-1: annotation credbroker.io/agent-spiffe-id="spiffe://fleet.example" names the trust domain, not an agent: invalid argument`,
		},
		{
			name: "annotation naming the profile's own default ID",
			td:   td,
			cp:   profile("fleet", "east-1", "spiffe://fleet.example/clusterprofile/fleet/east-1"),
			want: "spiffe://fleet.example/clusterprofile/fleet/east-1",
		},
		{
			name:    "annotation naming another profile's default ID",
			td:      td,
			cp:      profile("other", "evil", "spiffe://fleet.example/clusterprofile/fleet/prod"),
			wantErr: `clusterprofile other/evil: annotation credbroker.io/agent-spiffe-id="spiffe://fleet.example/clusterprofile/fleet/prod" lies under the reserved path /clusterprofile/, where each ClusterProfile owns only its own default ID; choose an ID outside it: invalid argument`,
		},
		{
			name:    "annotation naming the reserved path itself",
			td:      td,
			cp:      profile("other", "evil", "spiffe://fleet.example/clusterprofile"),
			wantErr: `clusterprofile other/evil: annotation credbroker.io/agent-spiffe-id="spiffe://fleet.example/clusterprofile" lies under the reserved path /clusterprofile/, where each ClusterProfile owns only its own default ID; choose an ID outside it: invalid argument`,
		},
		{
			name:    "annotation deeper under the reserved path",
			td:      td,
			cp:      profile("fleet", "east-1", "spiffe://fleet.example/clusterprofile/fleet/east-1/extra"),
			wantErr: `clusterprofile fleet/east-1: annotation credbroker.io/agent-spiffe-id="spiffe://fleet.example/clusterprofile/fleet/east-1/extra" lies under the reserved path /clusterprofile/, where each ClusterProfile owns only its own default ID; choose an ID outside it: invalid argument`,
		},
		{
			name: "annotation beside the reserved path",
			td:   td,
			cp:   profile("fleet", "east-1", "spiffe://fleet.example/clusterprofiles/fleet/prod"),
			want: "spiffe://fleet.example/clusterprofiles/fleet/prod",
		},
		{
			name:    "no trust domain",
			cp:      profile("fleet", "east-1"),
			wantErr: "agent ID of clusterprofile fleet/east-1: empty trust domain: invalid argument",
		},
		{
			name:    "nil",
			td:      td,
			wantErr: "agent ID of a nil ClusterProfile: invalid argument",
		},
		{
			name:    "no name",
			td:      td,
			cp:      profile("fleet", ""),
			wantErr: `clusterprofile "fleet"/"" has no default agent ID (path cannot contain empty segments): invalid argument`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			id, err := clusterprofile.AgentID(tt.td, tt.cp)
			if tt.wantErr != "" {
				require.EqualError(t, err, tt.wantErr)
				assert.ErrorIs(t, err, errdefs.ErrInvalidArgument)
				assert.True(t, id.IsZero())
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, id.String())
		})
	}
}
