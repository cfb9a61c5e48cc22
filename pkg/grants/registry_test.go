package grants

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/apimachinery/pkg/types"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/tunnel"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// fakeRevoker deletes what it is asked to, unless the cluster is offline.
type fakeRevoker struct {
	mu      sync.Mutex
	offline map[types.NamespacedName]bool
	calls   [][]string
	called  chan struct{}
}

func (f *fakeRevoker) Revoke(_ context.Context, cluster tunnel.ClusterRef, ids []string, _ string) ([]string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, ids)
	if f.called != nil {
		f.called <- struct{}{}
	}
	if f.offline[cluster.NamespacedName] {
		return nil, errdefs.ErrUnavailable
	}
	return ids, nil
}

var (
	start  = time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	spoke1 = tunnel.ClusterRef{NamespacedName: types.NamespacedName{Namespace: "fleet", Name: "spoke-1"}, UID: "uid-1"}
	spoke2 = tunnel.ClusterRef{NamespacedName: types.NamespacedName{Namespace: "fleet", Name: "spoke-2"}, UID: "uid-2"}
)

func grant(id, user string, ttl time.Duration) *pb.Grant {
	return &pb.Grant{
		CredentialId:   id,
		Subject:        &pb.Subject{Username: user},
		ExpirationTime: timestamppb.New(start.Add(ttl)),
	}
}

// on returns g as an agent of cluster reports it.
func on(cluster tunnel.ClusterRef, gs ...*pb.Grant) []*pb.Grant {
	for _, g := range gs {
		g.Cluster = &pb.ObjectReference{Namespace: cluster.Namespace, Name: cluster.Name}
	}
	return gs
}

func ids(gs []*pb.Grant) []string {
	out := []string{}
	for _, g := range gs {
		out = append(out, g.GetCredentialId())
	}
	return out
}

func newRegistry(t *testing.T) (*Registry, *fakeRevoker, *clocktesting.FakePassiveClock) {
	t.Helper()
	clk := clocktesting.NewFakePassiveClock(start)
	rev := &fakeRevoker{offline: map[types.NamespacedName]bool{}}
	r, err := NewRegistry(RegistryConfig{Revoker: rev, Clock: clk})
	require.NoError(t, err)
	return r, rev, clk
}

func TestRegistrySelect(t *testing.T) {
	r, _, _ := newRegistry(t)
	ctx := context.Background()
	r.Hello(ctx, spoke1, on(spoke1, grant("JTI=b", "alice", time.Hour), grant("JTI=a", "bob", 30*time.Minute)))
	r.Hello(ctx, spoke2, on(spoke2, grant("JTI=c", "alice", time.Hour), &pb.Grant{CredentialId: "JTI=no-expiry"}))
	// An agent cannot report another cluster's grants.
	r.Hello(ctx, spoke2, append(on(spoke2, grant("JTI=c", "alice", time.Hour)), on(spoke1, grant("JTI=x", "alice", time.Hour))...))

	tests := []struct {
		name string
		sel  Selector
		want []string
	}{
		{"all, by cluster then expiry", Selector{}, []string{"JTI=a", "JTI=b", "JTI=c"}},
		{"by user", Selector{Username: "alice"}, []string{"JTI=b", "JTI=c"}},
		{"by credential id", Selector{CredentialID: "JTI=c"}, []string{"JTI=c"}},
		{"by cluster", Selector{Cluster: spoke2.NamespacedName}, []string{"JTI=c"}},
		{"by cluster namespace", Selector{Cluster: types.NamespacedName{Namespace: "fleet"}}, []string{"JTI=a", "JTI=b", "JTI=c"}},
		{"by incarnation", Selector{Cluster: spoke1.NamespacedName, ClusterUID: "old"}, []string{}},
		{"all fields", Selector{Username: "alice", Cluster: spoke1.NamespacedName, CredentialID: "JTI=b"}, []string{"JTI=b"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, ids(r.Select(tt.sel)))
		})
	}
	got := r.Select(Selector{CredentialID: "JTI=c"})[0]
	assert.Equal(t, "spoke-2", got.GetCluster().GetName())
	assert.Equal(t, "uid-2", got.GetClusterUid())
}

func TestRegistryHelloAndUpdate(t *testing.T) {
	r, _, clk := newRegistry(t)
	ctx := context.Background()
	r.Hello(ctx, spoke1, on(spoke1, grant("JTI=a", "alice", time.Hour), grant("JTI=b", "alice", 20*time.Minute)))
	r.Hello(ctx, spoke2, on(spoke2, grant("JTI=c", "alice", time.Hour)))
	// A hello that lacks a grant does not remove it: another agent of the
	// ClusterProfile (scoped to a namespace, or on another cluster with the
	// profile's SVID) may not see it.
	r.Hello(ctx, spoke1, on(spoke1, grant("JTI=b", "alice", 20*time.Minute)))
	r.Hello(ctx, spoke1, nil)
	assert.Equal(t, []string{"JTI=b", "JTI=a", "JTI=c"}, ids(r.Select(Selector{})))

	r.Update(ctx, spoke1, &pb.GrantUpdate{Added: on(spoke1, grant("JTI=d", "bob", time.Hour)), Removed: []string{"JTI=b", "JTI=a"}})
	assert.Equal(t, []string{"JTI=d", "JTI=c"}, ids(r.Select(Selector{})))
	assert.True(t, r.Revoked("JTI=b"), "a grant an agent deleted is revoked")
	assert.False(t, r.Revoked("JTI=d"))

	// An agent of one cluster cannot remove another cluster's grants.
	r.Update(ctx, spoke1, &pb.GrantUpdate{Removed: []string{"JTI=c"}})
	assert.Equal(t, []string{"JTI=d", "JTI=c"}, ids(r.Select(Selector{})))
	assert.False(t, r.Revoked("JTI=c"))

	// Expired grants and what is known of them go.
	clk.SetTime(start.Add(30 * time.Minute))
	assert.False(t, r.Revoked("JTI=b"))
	r.Update(ctx, spoke1, &pb.GrantUpdate{Added: on(spoke1, grant("JTI=late", "bob", 10*time.Minute))})
	assert.Equal(t, []string{"JTI=d", "JTI=c"}, ids(r.Select(Selector{})))
}

func TestRegistryRevoke(t *testing.T) {
	r, rev, _ := newRegistry(t)
	ctx := context.Background()
	r.Hello(ctx, spoke1, on(spoke1, grant("JTI=a", "alice", time.Hour), grant("JTI=b", "bob", time.Hour)))
	r.Hello(ctx, spoke2, on(spoke2, grant("JTI=c", "alice", time.Hour)))
	rev.offline[spoke2.NamespacedName] = true

	revoked, pending := r.Revoke(ctx, r.Select(Selector{Username: "alice"}), "test")
	assert.Equal(t, []string{"JTI=a"}, ids(revoked))
	assert.Equal(t, []string{"JTI=c"}, ids(pending))
	assert.True(t, r.Revoked("JTI=a"))
	assert.True(t, r.Revoked("JTI=c"), "a pending revoke counts as revoked")
	assert.Equal(t, []string{"JTI=b", "JTI=c"}, ids(r.Select(Selector{})), "a pending grant is still live on its spoke")

	// The agent reconnects and reports the grant: the revoke goes again.
	rev.mu.Lock()
	rev.offline[spoke2.NamespacedName] = false
	rev.called = make(chan struct{}, 1)
	rev.mu.Unlock()
	r.Hello(ctx, spoke2, on(spoke2, grant("JTI=c", "alice", time.Hour)))
	select {
	case <-rev.called:
	case <-time.After(10 * time.Second):
		t.Fatal("the pending revoke was not sent again")
	}
	require.Eventually(t, func() bool { return len(r.Select(Selector{Cluster: spoke2.NamespacedName})) == 0 }, 10*time.Second, time.Millisecond)
	assert.True(t, r.Revoked("JTI=c"))

	// A grant reported again by an agent that has not seen the delete is
	// not live again.
	r.Update(ctx, spoke1, &pb.GrantUpdate{Added: on(spoke1, grant("JTI=a", "alice", time.Hour))})
	assert.Equal(t, []string{"JTI=b"}, ids(r.Select(Selector{})))
}

func TestRegistryRevokesGrantsOfAReplacedClusterProfile(t *testing.T) {
	r, rev, _ := newRegistry(t)
	rev.called = make(chan struct{}, 1)
	old := grant("JTI=old", "alice", time.Hour)
	old.ClusterUid = "uid-before"
	r.Hello(context.Background(), spoke1, on(spoke1, old, grant("JTI=new", "alice", time.Hour)))
	select {
	case <-rev.called:
	case <-time.After(10 * time.Second):
		t.Fatal("the grant of the earlier incarnation was not revoked")
	}
	rev.mu.Lock()
	assert.Equal(t, [][]string{{"JTI=old"}}, rev.calls)
	rev.mu.Unlock()
	assert.Equal(t, []string{"JTI=new"}, ids(r.Select(Selector{})))
}

func TestRegistryBoundsTheGrantsOfOneCluster(t *testing.T) {
	rev := &fakeRevoker{offline: map[types.NamespacedName]bool{}}
	r, err := NewRegistry(RegistryConfig{Revoker: rev, Clock: clocktesting.NewFakePassiveClock(start), MaxGrantsPerCluster: 2})
	require.NoError(t, err)
	ctx := context.Background()
	// A flood from one agent fills only its own cluster's share.
	r.Hello(ctx, spoke1, on(spoke1, grant("JTI=a", "x", time.Hour), grant("JTI=b", "x", time.Hour), grant("JTI=c", "x", time.Hour)))
	r.Update(ctx, spoke1, &pb.GrantUpdate{Added: on(spoke1, grant("JTI=d", "x", time.Hour))})
	assert.Len(t, r.Select(Selector{Cluster: spoke1.NamespacedName}), 2)
	// A grant already held can be reported again, and room frees as grants go.
	r.Update(ctx, spoke1, &pb.GrantUpdate{Added: on(spoke1, grant("JTI=a", "x", time.Hour))})
	r.Update(ctx, spoke1, &pb.GrantUpdate{Removed: []string{"JTI=a"}, Added: on(spoke1, grant("JTI=d", "x", time.Hour))})
	assert.Equal(t, []string{"JTI=b", "JTI=d"}, ids(r.Select(Selector{Cluster: spoke1.NamespacedName})))
	r.Hello(ctx, spoke2, on(spoke2, grant("JTI=e", "y", time.Hour), grant("JTI=f", "y", time.Hour)))
	assert.Len(t, r.Select(Selector{Cluster: spoke2.NamespacedName}), 2)
}
