package clusterprofile_test

import (
	"errors"
	"strings"
	"testing"
	"time"

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

// BenchmarkLookupCluster is the lookup every exchange makes, cached ones
// included, of a ClusterProfile with a CA of a real certificate's size.
func BenchmarkLookupCluster(b *testing.B) {
	ca := strings.Repeat("c", 1200)
	h := start(b, withAccess(profile("fleet", "east-1"), provider("credbroker", "https://east.example:6443", ca)))
	lookup := clusterprofile.Lookup{Index: h.idx, Provider: "credbroker"}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := lookup.Cluster("fleet", "east-1"); err != nil {
			b.Fatal(err)
		}
	}
}

// The lookup derives a ClusterProfile's answer once per object, but answers
// from the object the informer holds now: a new server, a new CA, a
// ClusterProfile that took the agent ID over, and a deletion are each seen
// at the next exchange.
func TestLookupFollowsChanges(t *testing.T) {
	east := createdAt(withUID(withAccess(profile("fleet", "east-1"), provider("credbroker", "https://east.example", "ca-1")), "uid-east"), 10)
	h := start(t, east)
	lookup := clusterprofile.Lookup{Index: h.idx, Provider: "credbroker"}
	eventually := func(check func(fleet.Cluster, error) bool) {
		t.Helper()
		require.Eventually(t, func() bool { return check(lookup.Cluster("fleet", "east-1")) }, 5*time.Second, time.Millisecond)
	}
	got, err := lookup.Cluster("fleet", "east-1")
	require.NoError(t, err)
	assert.Equal(t, "https://east.example", got.Server)

	h.src.Update(withAccess(east.DeepCopy(), provider("credbroker", "https://east-2.example", "ca-2")))
	eventually(func(c fleet.Cluster, err error) bool {
		return err == nil && c.Server == "https://east-2.example" && string(c.CAData) == "ca-2"
	})

	// Another ClusterProfile claims east-1's agent ID, and claimed it
	// first: east-1 is no longer served, though its own object is the same.
	shared := "spiffe://" + td.Name() + "/agents/shared"
	thief := createdAt(withUID(withAccess(profile("fleet", "thief-1", shared), provider("credbroker", "https://thief.example", "")), "uid-thief"), 1)
	claimed := withAccess(east.DeepCopy(), provider("credbroker", "https://east-2.example", "ca-2"))
	claimed.Annotations = map[string]string{clusterprofile.AgentSPIFFEIDAnnotation: shared}
	h.src.Update(claimed)
	eventually(func(c fleet.Cluster, err error) bool { return err == nil })
	h.src.Add(thief)
	eventually(func(_ fleet.Cluster, err error) bool {
		return errors.Is(err, errdefs.ErrFailedPrecondition) && strings.Contains(err.Error(), "fleet/thief-1 claimed first")
	})

	h.src.Delete("fleet", "thief-1")
	eventually(func(_ fleet.Cluster, err error) bool { return err == nil })
	h.src.Delete("fleet", "east-1")
	eventually(func(_ fleet.Cluster, err error) bool { return errors.Is(err, errdefs.ErrNotFound) })
}
