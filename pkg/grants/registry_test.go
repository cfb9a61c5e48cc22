package grants

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"google.golang.org/protobuf/proto"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/apimachinery/pkg/types"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// fakeRevoker deletes what it is asked to, unless the cluster is offline.
type fakeRevoker struct {
	mu      sync.Mutex
	offline map[types.NamespacedName]bool
	calls   [][]string
	called  chan struct{}
}

func (f *fakeRevoker) Revoke(_ context.Context, cluster fleet.ClusterRef, ids []string, _ string) ([]string, error) {
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
	spoke1 = fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: "fleet", Name: "spoke-1"}, UID: "uid-1"}
	spoke2 = fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: "fleet", Name: "spoke-2"}, UID: "uid-2"}
)

func grant(id, user string, ttl time.Duration) *pb.Grant {
	return &pb.Grant{
		CredentialId:   id,
		Subject:        &pb.Subject{Username: user},
		ExpirationTime: timestamppb.New(start.Add(ttl)),
	}
}

// on returns g as an agent of cluster reports it.
func on(cluster fleet.ClusterRef, gs ...*pb.Grant) []*pb.Grant {
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

// A report that would make one ClusterProfile hold more live grants than
// MaxGrantsPerCluster is refused whole, and others' shares stay theirs.
func TestRegistryBoundsTheGrantsOfOneCluster(t *testing.T) {
	rev := &fakeRevoker{offline: map[types.NamespacedName]bool{}}
	r, err := NewRegistry(RegistryConfig{Revoker: rev, Clock: clocktesting.NewFakePassiveClock(start), MaxGrantsPerCluster: 2})
	require.NoError(t, err)
	ctx := context.Background()
	// A flood from one agent is refused, and fills nothing.
	err = r.Hello(ctx, spoke1, on(spoke1, grant("JTI=a", "x", time.Hour), grant("JTI=b", "x", time.Hour), grant("JTI=c", "x", time.Hour)))
	require.ErrorIs(t, err, errdefs.ErrResourceExhausted)
	assert.Empty(t, r.Select(Selector{Cluster: spoke1.NamespacedName}))
	require.NoError(t, r.Hello(ctx, spoke1, on(spoke1, grant("JTI=a", "x", time.Hour), grant("JTI=b", "x", time.Hour))))
	require.ErrorIs(t, r.Report(ctx, spoke1, &pb.GrantUpdate{Added: on(spoke1, grant("JTI=d", "x", time.Hour))}), errdefs.ErrResourceExhausted)
	// A grant already held can be reported again, and room frees as grants go.
	require.NoError(t, r.Report(ctx, spoke1, &pb.GrantUpdate{Added: on(spoke1, grant("JTI=a", "x", time.Hour))}))
	require.NoError(t, r.Report(ctx, spoke1, &pb.GrantUpdate{Removed: []string{"JTI=a"}, Added: on(spoke1, grant("JTI=d", "x", time.Hour))}))
	assert.Equal(t, []string{"JTI=b", "JTI=d"}, ids(r.Select(Selector{Cluster: spoke1.NamespacedName})))
	require.NoError(t, r.Hello(ctx, spoke2, on(spoke2, grant("JTI=e", "y", time.Hour), grant("JTI=f", "y", time.Hour))))
	assert.Len(t, r.Select(Selector{Cluster: spoke2.NamespacedName}), 2)
}

// big returns a grant of about size bytes, its subject's groups.
func big(id string, size int, ttl time.Duration) *pb.Grant {
	g := grant(id, "x", ttl)
	for n := 0; n < size; n += 20 {
		g.Subject.Groups = append(g.Subject.Groups, fmt.Sprintf("group-%014d", n))
	}
	return g
}

// The attack: a compromised agent reports grants past the registry's
// bounds. A grant past a bound of its own (its size, its credential id, its
// expiry) is dropped and logged with the bound, and the rest of the report
// is held: trust round 3 found that refusing the whole report, and closing
// the stream, let one grant Secret with an expiry ten years ahead, written
// on the spoke by a stolen agent identity, cut every consumer of the spoke
// off, at every hello. A report past its ClusterProfile's share is refused
// with the code that says why, logged with the bound, and adds nothing.
func TestRegistryRefusesReportsPastItsBounds(t *testing.T) {
	for _, tc := range []struct {
		name      string
		cfg       RegistryConfig
		held      []*pb.Grant // reported first, and taken
		report    *pb.GrantUpdate
		wantErr   error  // the report is refused
		wantBound string // the bound logged, for a refusal or a drop
		wantHeld  []string
	}{
		{
			name:      "a grant larger than MaxGrantBytes",
			cfg:       RegistryConfig{MaxGrantBytes: 4 << 10},
			report:    &pb.GrantUpdate{Added: on(spoke1, grant("JTI=ok", "x", time.Hour), big("JTI=big", 5<<10, time.Hour))},
			wantBound: "grantBytes",
			wantHeld:  []string{"JTI=ok"},
		},
		{
			name:   "a grant of exactly MaxGrantBytes",
			cfg:    RegistryConfig{MaxGrantBytes: proto.Size(on(spoke1, big("JTI=big", 4<<10, time.Hour))[0])},
			report: &pb.GrantUpdate{Added: on(spoke1, big("JTI=big", 4<<10, time.Hour))}, wantHeld: []string{"JTI=big"},
		},
		{
			name:      "an expiry past the maximum lifetime and the clock skew",
			report:    &pb.GrantUpdate{Added: on(spoke1, grant("JTI=ok", "x", time.Hour), grant("JTI=century", "x", 100*365*24*time.Hour))},
			wantBound: "grantLifetime",
			wantHeld:  []string{"JTI=ok"},
		},
		{
			name:      "an expiry a second past the maximum lifetime and the clock skew",
			cfg:       RegistryConfig{MaxGrantLifetime: 2 * time.Hour},
			report:    &pb.GrantUpdate{Added: on(spoke1, grant("JTI=late", "x", 2*time.Hour+time.Minute+time.Second))},
			wantBound: "grantLifetime",
		},
		{
			name:     "an expiry of exactly the maximum lifetime and the clock skew",
			cfg:      RegistryConfig{MaxGrantLifetime: 2 * time.Hour},
			report:   &pb.GrantUpdate{Added: on(spoke1, grant("JTI=edge", "x", 2*time.Hour+time.Minute))},
			wantHeld: []string{"JTI=edge"},
		},
		{
			name:      "a credential id longer than MaxCredentialIDBytes",
			report:    &pb.GrantUpdate{Added: on(spoke1, grant("JTI="+strings.Repeat("j", 129), "x", time.Hour), grant("JTI=ok", "x", time.Hour))},
			wantBound: "credentialIDBytes",
			wantHeld:  []string{"JTI=ok"},
		},
		{
			name:     "a credential id of MaxCredentialIDBytes",
			report:   &pb.GrantUpdate{Added: on(spoke1, grant("JTI="+strings.Repeat("j", 128), "x", time.Hour))},
			wantHeld: []string{"JTI=" + strings.Repeat("j", 128)},
		},
		{
			name:      "more bytes than the ClusterProfile may hold",
			cfg:       RegistryConfig{MaxGrantBytesPerCluster: 10 << 10},
			held:      on(spoke1, big("JTI=a", 4<<10, time.Hour), big("JTI=b", 4<<10, time.Hour)),
			report:    &pb.GrantUpdate{Added: on(spoke1, big("JTI=c", 4<<10, time.Hour))},
			wantErr:   errdefs.ErrResourceExhausted,
			wantBound: "clusterBytes",
			wantHeld:  []string{"JTI=a", "JTI=b"},
		},
		{
			name:     "a removal in the same report frees the room",
			cfg:      RegistryConfig{MaxGrantBytesPerCluster: 10 << 10},
			held:     on(spoke1, big("JTI=a", 4<<10, time.Hour), big("JTI=b", 4<<10, time.Hour)),
			report:   &pb.GrantUpdate{Removed: []string{"JTI=a"}, Added: on(spoke1, big("JTI=c", 4<<10, time.Hour))},
			wantHeld: []string{"JTI=b", "JTI=c"},
		},
		{
			name:     "a grant reported again replaces itself",
			cfg:      RegistryConfig{MaxGrantBytesPerCluster: 10 << 10},
			held:     on(spoke1, big("JTI=a", 4<<10, time.Hour), big("JTI=b", 4<<10, time.Hour)),
			report:   &pb.GrantUpdate{Added: on(spoke1, big("JTI=a", 4<<10, time.Hour), big("JTI=a", 4<<10, time.Hour))},
			wantHeld: []string{"JTI=a", "JTI=b"},
		},
		{
			name: "deleted grants count until they expire",
			// Each cycle of report and delete leaves a record: an agent
			// cannot churn credential ids without bound.
			cfg:       RegistryConfig{MaxGrantBytesPerCluster: 600}, // two of these grants
			held:      on(spoke1, grant("JTI=r-1", "x", time.Hour), grant("JTI=r-2", "x", time.Hour)),
			report:    &pb.GrantUpdate{Removed: []string{"JTI=r-1", "JTI=r-2"}, Added: on(spoke1, grant("JTI=r-3", "x", time.Hour), grant("JTI=r-4", "x", time.Hour))},
			wantErr:   errdefs.ErrResourceExhausted,
			wantBound: "clusterBytes",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logs strings.Builder
			cfg := tc.cfg
			cfg.Revoker = &fakeRevoker{offline: map[types.NamespacedName]bool{}}
			cfg.Clock = clocktesting.NewFakePassiveClock(start)
			cfg.Log = funcr.New(func(prefix, args string) { logs.WriteString(args + "\n") }, funcr.Options{})
			r, err := NewRegistry(cfg)
			require.NoError(t, err)
			ctx := context.Background()
			if tc.held != nil {
				require.NoError(t, r.Hello(ctx, spoke1, tc.held))
			}
			err = r.Report(ctx, spoke1, tc.report)
			switch {
			case tc.wantErr != nil:
				require.ErrorIs(t, err, tc.wantErr)
				assert.Contains(t, logs.String(), `"msg"="agent grant report refused; closing the stream" "cluster"="fleet/spoke-1" "frame"="grant update" "bound"="`+tc.wantBound+`"`)
			case tc.wantBound != "":
				require.NoError(t, err, "a grant past its own bound refused the whole report")
				assert.Contains(t, logs.String(), `"msg"="agent reported grants past a bound; dropped them and kept the rest of the report" "cluster"="fleet/spoke-1" "frame"="grant update" "bound"="`+tc.wantBound+`"`)
				assert.Contains(t, logs.String(), `"dropped"=1`)
			default:
				require.NoError(t, err)
				assert.Empty(t, logs.String())
			}
			assert.ElementsMatch(t, tc.wantHeld, ids(r.Select(Selector{})))
			// The hello is held to the same bounds.
			if len(tc.report.GetRemoved()) == 0 && tc.held == nil {
				r, err := NewRegistry(cfg)
				require.NoError(t, err)
				err = r.Hello(ctx, spoke1, tc.report.GetAdded())
				if tc.wantErr != nil {
					require.ErrorIs(t, err, tc.wantErr)
				} else {
					require.NoError(t, err)
				}
				assert.ElementsMatch(t, tc.wantHeld, ids(r.Select(Selector{})))
			}
		})
	}
}

// Expired grants and records leave the registry, and free their
// ClusterProfile's share.
func TestRegistryExpiryFreesTheShare(t *testing.T) {
	clk := clocktesting.NewFakePassiveClock(start)
	r, err := NewRegistry(RegistryConfig{Revoker: &fakeRevoker{}, Clock: clk, MaxGrantsPerCluster: 2})
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, r.Hello(ctx, spoke1, on(spoke1, grant("JTI=a", "x", 20*time.Minute), grant("JTI=b", "x", time.Hour))))
	require.NoError(t, r.Report(ctx, spoke1, &pb.GrantUpdate{Removed: []string{"JTI=b"}}))
	assert.True(t, r.Revoked("JTI=b"))
	clk.SetTime(start.Add(30 * time.Minute))
	require.NoError(t, r.Report(ctx, spoke1, &pb.GrantUpdate{Added: on(spoke1, grant("JTI=c", "x", time.Hour), grant("JTI=d", "x", time.Hour))}))
	assert.Equal(t, []string{"JTI=c", "JTI=d"}, ids(r.Select(Selector{})))
	clk.SetTime(start.Add(2 * time.Hour))
	require.NoError(t, r.Report(ctx, spoke1, &pb.GrantUpdate{}))
	assert.False(t, r.Revoked("JTI=b"))
	r.mu.RLock()
	defer r.mu.RUnlock()
	assert.Empty(t, r.live)
	assert.Empty(t, r.revoked)
	assert.Empty(t, r.use, "what expired still counts against its ClusterProfile")
	assert.Empty(t, r.byCluster)
	assert.Empty(t, r.byUser)
	assert.Empty(t, r.liveQueue)
	assert.Empty(t, r.revokedQueue)
}
