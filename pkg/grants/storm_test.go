package grants

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// stormRevoker counts the revokes it is sent, and how many are in flight
// at once. While held, a revoke waits, as one does on a rogue stream that
// never answers; while offline, it fails as when no agent is connected.
type stormRevoker struct {
	mu       sync.Mutex
	calls    []revokeCall
	inFlight int
	peak     int
	offline  bool
	hold     chan struct{} // nil: answer at once
}

func (s *stormRevoker) Revoke(ctx context.Context, cluster fleet.ClusterRef, ids []string, reason string) ([]string, error) {
	s.mu.Lock()
	s.calls = append(s.calls, revokeCall{cluster: cluster, ids: slices.Clone(ids), reason: reason})
	s.inFlight++
	s.peak = max(s.peak, s.inFlight)
	hold, offline := s.hold, s.offline
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.inFlight--
		s.mu.Unlock()
	}()
	if hold != nil {
		select {
		case <-hold:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if offline {
		return nil, fmt.Errorf("%w: %w", fleet.ErrNoAgent, errdefs.ErrUnavailable)
	}
	return ids, nil
}

func (s *stormRevoker) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.calls)
}

func (s *stormRevoker) sent(id string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, c := range s.calls {
		if slices.Contains(c.ids, id) {
			n++
		}
	}
	return n
}

func (s *stormRevoker) set(f func(s *stormRevoker)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f(s)
}

func stormGrants(n int) ([]*pb.Grant, []string) {
	gs := make([]*pb.Grant, n)
	list := make([]string, n)
	for i := range gs {
		list[i] = fmt.Sprintf("JTI=storm-%d", i)
		gs[i] = grant(list[i], "alice", time.Hour)
	}
	return on(spoke1, gs...), list
}

// The attack: a holder of a cluster's agent SVID reports revoked ids live,
// reports them removed, and reports them again, in a loop of 1,000 rounds,
// on a stream that never answers a revoke. Each report of a revoked id
// sends its revoke again, to every agent instance, and each honest agent
// LISTs its spoke for every id it does not hold. Had each report started a
// send of its own, the broker would hold one goroutine per frame, each
// waiting on the rogue's stream, and send without bound. At most one send
// per ClusterProfile is in flight, what the reports add meanwhile is sent
// once after it, and one id is sent again at most once per RetryInterval.
func TestRogueReportLoopSendsBoundedRevokes(t *testing.T) {
	const interval = 10 * time.Second
	ctx := context.Background()
	clk := clocktesting.NewFakeClock(start)
	rev := &stormRevoker{}
	r, err := NewRegistry(RegistryConfig{Revoker: rev, Clock: clk, RetryInterval: interval})
	require.NoError(t, err)
	gs, list := stormGrants(64)
	require.NoError(t, r.Hello(ctx, spoke1, gs))
	revoked, _ := r.Revoke(ctx, r.Select(Selector{Cluster: spoke1.NamespacedName}), "the token leaked")
	require.Len(t, revoked, len(gs))
	require.Equal(t, 1, rev.count())

	hold := make(chan struct{})
	rev.set(func(s *stormRevoker) { s.hold = hold })
	before := runtime.NumGoroutine()
	const rounds = 1000
	for range rounds {
		again, _ := stormGrants(64)
		require.NoError(t, r.Report(ctx, spoke1, &pb.GrantUpdate{Added: again}))
		require.NoError(t, r.Report(ctx, spoke1, &pb.GrantUpdate{Removed: list}))
		again, _ = stormGrants(64)
		require.NoError(t, r.Report(ctx, spoke1, &pb.GrantUpdate{Added: again}))
	}
	grown := runtime.NumGoroutine() - before
	rev.mu.Lock()
	inFlight := rev.inFlight
	rev.mu.Unlock()
	t.Logf("after %d rounds: %d goroutines more, %d revokes in flight, %d sent", rounds, grown, inFlight, rev.count()-1)
	assert.LessOrEqual(t, grown, 4, "the reports left goroutines waiting on the rogue's stream")
	assert.LessOrEqual(t, inFlight, 1, "more than one revoke of the cluster in flight")
	close(hold)

	// What the loop added meanwhile waits for the interval, then goes once.
	require.Eventually(t, clk.HasWaiters, 10*time.Second, time.Millisecond)
	assert.Equal(t, 2, rev.count(), "the revokes of the loop were not coalesced")
	clk.Step(interval)
	require.Eventually(t, func() bool { return rev.count() == 3 }, 10*time.Second, time.Millisecond)
	require.Eventually(t, func() bool { return !clk.HasWaiters() }, 10*time.Second, time.Millisecond)
	for _, id := range list {
		assert.Equal(t, 3, rev.sent(id), "id %s", id)
	}
	rev.mu.Lock()
	defer rev.mu.Unlock()
	assert.Equal(t, 1, rev.peak, "more than one revoke of the cluster in flight")
	t.Logf("%d rounds of report, remove and report again: %d revokes sent again, at most %d in flight", rounds, len(rev.calls)-1, rev.peak)
}

// A revoke that is pending while its agent is away still reaches the agent
// when it comes back: at once, or, when a send of the same id went a
// moment before (a rogue stream's hello, say), once RetryInterval passed.
func TestPendingRevokeIsDeliveredWhenItsAgentComesBack(t *testing.T) {
	const interval = 10 * time.Second
	tests := []struct {
		name string
		// away runs while the agent is away.
		away func(t *testing.T, r *Registry, clk *clocktesting.FakeClock)
	}{
		{name: "the agent comes back later", away: func(t *testing.T, r *Registry, clk *clocktesting.FakeClock) {
			clk.Step(interval)
		}},
		{name: "a rogue hello sent the revoke a moment before", away: func(t *testing.T, r *Registry, clk *clocktesting.FakeClock) {
			require.NoError(t, r.Hello(context.Background(), spoke1, nil))
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			clk := clocktesting.NewFakeClock(start)
			rev := &stormRevoker{offline: true}
			rec := &fakeRecorder{}
			r, err := NewRegistry(RegistryConfig{Revoker: rev, Clock: clk, Pending: rec, RetryInterval: interval})
			require.NoError(t, err)
			gs, list := stormGrants(2)
			require.NoError(t, r.Hello(ctx, spoke1, gs))
			revoked, pending := r.Revoke(ctx, r.Select(Selector{Cluster: spoke1.NamespacedName}), "the token leaked")
			require.Empty(t, revoked)
			require.Len(t, pending, 2)

			tt.away(t, r, clk)
			require.Eventually(t, func() bool { return rev.count() >= 1 && !rev.busy() }, 10*time.Second, time.Millisecond)

			rev.set(func(s *stormRevoker) { s.offline = false })
			again, _ := stormGrants(2)
			require.NoError(t, r.Hello(ctx, spoke1, again))
			require.Eventually(t, func() bool {
				forgot := rec.forgotten()
				if slices.Contains(forgot, list[0]) && slices.Contains(forgot, list[1]) {
					return true
				}
				if clk.HasWaiters() { // the send waits for the interval
					clk.Step(interval)
				}
				return false
			}, 10*time.Second, time.Millisecond, "the revoke did not reach the agent that came back")
			assert.Empty(t, r.Select(Selector{Cluster: spoke1.NamespacedName}))
			for _, id := range list {
				assert.True(t, r.Revoked(id))
			}
		})
	}
}

func (s *stormRevoker) busy() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.inFlight > 0
}

// The attack: a hand-edited pending-revokes record names the credential id
// of a live grant of spoke-2 under spoke-1. Spoke-1's agents do not hold
// it and answer it gone; had the broker then dropped the grant whatever
// ClusterProfile holds it, spoke-2's grant would vanish from the registry,
// and with it from Grants.List, Grants.Revoke and every revoke trigger,
// while its token lives on. A revoke acts only on ids of its own
// ClusterProfile.
func TestRevokeOfAnotherClustersIDDropsNothing(t *testing.T) {
	const id = "JTI=of-spoke-2"
	forged := func() *pb.Grant {
		g := on(spoke1, grant(id, "mallory", time.Hour))[0]
		g.ClusterUid = string(spoke1.UID)
		return g
	}
	tests := []struct {
		name  string
		forge func(r *Registry)
	}{
		{name: "a learnt record", forge: func(r *Registry) {
			r.Learn(context.Background(), []PendingRevoke{{Grant: forged(), Reason: "forged"}})
		}},
		{name: "a revoke", forge: func(r *Registry) {
			r.Revoke(context.Background(), []*pb.Grant{forged()}, "forged")
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			var logs strings.Builder
			var logMu sync.Mutex
			rev := &clusterRevoker{offline: map[string]bool{}}
			r, err := NewRegistry(RegistryConfig{Revoker: rev, Clock: clocktesting.NewFakeClock(start),
				Log: funcr.New(func(_, args string) {
					logMu.Lock()
					defer logMu.Unlock()
					logs.WriteString(args + "\n")
				}, funcr.Options{})})
			require.NoError(t, err)
			require.NoError(t, r.Hello(ctx, spoke2, on(spoke2, grant(id, "bob", time.Hour))))

			tt.forge(r)
			require.Eventually(t, func() bool {
				logMu.Lock()
				defer logMu.Unlock()
				return strings.Contains(logs.String(), "revoke of another ClusterProfile's credential id ignored") ||
					len(r.Select(Selector{CredentialID: id})) == 0
			}, 10*time.Second, time.Millisecond)
			got := r.Select(Selector{CredentialID: id})
			require.Len(t, got, 1, "spoke-2's live grant was dropped")
			assert.Equal(t, "spoke-2", got[0].GetCluster().GetName())
			assert.False(t, r.Revoked(id), "spoke-2's grant counts as revoked")
			assert.Empty(t, rev.sentTo(spoke1), "spoke-1's agents were asked about spoke-2's grant")
			// Spoke-2's agent still reports it, and a revoke still finds it.
			revoked, _ := r.Revoke(ctx, r.Select(Selector{Username: "bob"}), "test")
			assert.Equal(t, []string{id}, ids(revoked))
		})
	}
}

// A send that found no agent connected sent nothing, so it does not count
// against RetryInterval: the agent that connects next gets the revoke at
// its hello, not an interval later.
func TestRevokeThatFoundNoAgentIsSentAtTheNextHello(t *testing.T) {
	ctx := context.Background()
	clk := clocktesting.NewFakeClock(start)
	rev := &stormRevoker{offline: true}
	rec := &fakeRecorder{}
	r, err := NewRegistry(RegistryConfig{Revoker: rev, Clock: clk, Pending: rec, RetryInterval: time.Hour})
	require.NoError(t, err)
	gs, list := stormGrants(1)
	r.Learn(ctx, []PendingRevoke{{Grant: gs[0], Reason: "the token leaked"}})
	require.Eventually(t, func() bool { return rev.count() >= 1 && !rev.busy() }, 10*time.Second, time.Millisecond)

	rev.set(func(s *stormRevoker) { s.offline = false })
	require.NoError(t, r.Hello(ctx, spoke1, gs))
	require.Eventually(t, func() bool { return slices.Contains(rec.forgotten(), list[0]) }, 10*time.Second, time.Millisecond,
		"the revoke waited for the interval (the clock never moves here)")
}
