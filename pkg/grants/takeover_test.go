package grants

import (
	"context"
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

// clusterRevoker records which cluster each revoke was sent to, deletes
// what it is asked to while the cluster is online, and answers
// ErrUnavailable while it is not.
type clusterRevoker struct {
	mu      sync.Mutex
	offline map[string]bool
	calls   []revokeCall
}

func (c *clusterRevoker) Revoke(_ context.Context, cluster fleet.ClusterRef, ids []string, reason string) ([]string, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.calls = append(c.calls, revokeCall{cluster: cluster, ids: slices.Clone(ids), reason: reason})
	if c.offline[cluster.String()] {
		return nil, errdefs.ErrUnavailable
	}
	return ids, nil
}

func (c *clusterRevoker) setOffline(cluster fleet.ClusterRef, offline bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.offline[cluster.String()] = offline
}

// sentTo returns the calls that reached cluster.
func (c *clusterRevoker) sentTo(cluster fleet.ClusterRef) []revokeCall {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []revokeCall
	for _, call := range c.calls {
		if call.cluster == cluster {
			out = append(out, call)
		}
	}
	return out
}

// reported has spoke-2's agent report the victim's grant.
func reported(t *testing.T, r *Registry, _ *clusterRevoker) {
	require.NoError(t, r.Hello(context.Background(), spoke2, on(spoke2, grant("JTI=victim", "alice", time.Hour))))
}

// The attack: the agent of one ClusterProfile (spoke-1), or anyone who can
// make it report a grant Secret, reports a grant under the credential id of
// another ClusterProfile's grant (spoke-2's). The credential id is in the
// victim consumer's own token, the spoke's audit log and the grant's jti
// label. Had the registry taken the report, a revoke of the id would go to
// spoke-1's agent, which deletes its forgery and answers "gone", while
// spoke-2's grant and its token live on.
func TestAgentCannotTakeAnotherClustersGrant(t *testing.T) {
	const victim = "JTI=victim"
	tests := []struct {
		name string
		// state puts the victim's grant, which spoke-2's agent reported,
		// where the case needs it.
		state func(t *testing.T, r *Registry, rev *clusterRevoker)
		// live: the victim's grant is still listed (live, or pending
		// revoke) after the attack.
		live bool
		// holds is what the registry holds of the victim's grant.
		holds string
	}{
		{name: "live", state: reported, live: true, holds: "live"},
		{
			// The grant stays listed while its revoke is pending.
			name: "live, its revoke pending",
			state: func(t *testing.T, r *Registry, rev *clusterRevoker) {
				reported(t, r, rev)
				rev.setOffline(spoke2, true)
				revoked, pending := r.Revoke(context.Background(), r.Select(Selector{CredentialID: victim}), "test")
				require.Empty(t, revoked)
				require.Equal(t, []string{victim}, ids(pending))
			},
			live: true, holds: "live",
		},
		{
			// Another replica recorded the revoke; this one never saw
			// the grant live.
			name: "pending",
			state: func(t *testing.T, r *Registry, rev *clusterRevoker) {
				rev.setOffline(spoke2, true)
				g := on(spoke2, grant(victim, "alice", time.Hour))[0]
				g.ClusterUid = string(spoke2.UID)
				r.Learn(context.Background(), []PendingRevoke{{Grant: g, Reason: "test"}})
			},
			holds: "pending",
		},
		{
			name: "revoked",
			state: func(t *testing.T, r *Registry, rev *clusterRevoker) {
				reported(t, r, rev)
				revoked, _ := r.Revoke(context.Background(), r.Select(Selector{CredentialID: victim}), "test")
				require.Equal(t, []string{victim}, ids(revoked))
			},
			holds: "revoked",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			var logs strings.Builder
			var logMu sync.Mutex
			rev := &clusterRevoker{offline: map[string]bool{}}
			r, err := NewRegistry(RegistryConfig{Revoker: rev, Clock: clocktesting.NewFakePassiveClock(start),
				Log: funcr.New(func(_, args string) {
					logMu.Lock()
					defer logMu.Unlock()
					logs.WriteString(args + "\n")
				}, funcr.Options{})})
			require.NoError(t, err)
			tt.state(t, r, rev)

			// The attack, in a hello and in a grant update.
			require.NoError(t, r.Hello(ctx, spoke1, on(spoke1, grant(victim, "mallory", time.Hour))))
			require.NoError(t, r.Report(ctx, spoke1, &pb.GrantUpdate{Added: on(spoke1, grant(victim, "mallory", time.Hour))}))
			assert.Empty(t, r.Select(Selector{Cluster: spoke1.NamespacedName}), "spoke-1 took the victim's credential id")
			// And a removal: spoke-1's agent cannot report spoke-2's grant gone.
			require.NoError(t, r.Report(ctx, spoke1, &pb.GrantUpdate{Removed: []string{victim}}))

			logMu.Lock()
			assert.Contains(t, logs.String(), `"msg"="agent reported the credential id of another ClusterProfile's grant; ignored it" `+
				`"cluster"="fleet/spoke-1" "holder"="fleet/spoke-2" "credentialID"="JTI=victim" "state"="`+tt.holds+`"`)
			logMu.Unlock()
			got := r.Select(Selector{CredentialID: victim})
			if !tt.live {
				assert.Empty(t, got)
				assert.True(t, r.Revoked(victim))
				assert.Empty(t, rev.sentTo(spoke1), "a revoke of spoke-2's grant went to spoke-1")
				return
			}
			require.Len(t, got, 1)
			assert.Equal(t, spoke2.Name, got[0].GetCluster().GetName())
			assert.Equal(t, "alice", got[0].GetSubject().GetUsername())

			// The revoke of the id reaches spoke-2's agent, which deletes
			// the real grant.
			rev.setOffline(spoke2, false)
			revoked, pending := r.Revoke(ctx, got, "test")
			assert.Equal(t, []string{victim}, ids(revoked))
			assert.Empty(t, pending)
			assert.Empty(t, rev.sentTo(spoke1), "a revoke of spoke-2's grant went to spoke-1")
			calls := rev.sentTo(spoke2)
			require.NotEmpty(t, calls)
			assert.Equal(t, []string{victim}, calls[len(calls)-1].ids)
		})
	}
}

// The attack: a revoke is counted done on the word of agents that did not
// hold the grant (a rogue holder of the cluster's SVID answering "gone"
// while the honest agent was reconnecting), and the honest agent then
// reports the grant live. The revoke is sent again, with its reason, every
// time an agent of the cluster reports the grant, until its token expires.
func TestRevokedGrantReportedAgainIsRevokedAgain(t *testing.T) {
	const id = "JTI=survivor"
	tests := []struct {
		name   string
		report func(r *Registry) error
	}{
		{name: "hello", report: func(r *Registry) error {
			return r.Hello(context.Background(), spoke1, on(spoke1, grant(id, "alice", time.Hour)))
		}},
		{name: "grant update", report: func(r *Registry) error {
			return r.Report(context.Background(), spoke1, &pb.GrantUpdate{Added: on(spoke1, grant(id, "alice", time.Hour))})
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			rev := &clusterRevoker{offline: map[string]bool{}}
			r, err := NewRegistry(RegistryConfig{Revoker: rev, Clock: clocktesting.NewFakePassiveClock(start)})
			require.NoError(t, err)
			require.NoError(t, r.Hello(ctx, spoke1, on(spoke1, grant(id, "alice", time.Hour))))
			revoked, _ := r.Revoke(ctx, r.Select(Selector{CredentialID: id}), "the token leaked")
			require.Equal(t, []string{id}, ids(revoked))
			require.Len(t, rev.sentTo(spoke1), 1)

			require.NoError(t, tt.report(r))
			require.Eventually(t, func() bool { return len(rev.sentTo(spoke1)) == 2 }, 10*time.Second, time.Millisecond,
				"a revoked grant that an agent reported live again was not revoked again")
			again := rev.sentTo(spoke1)[1]
			assert.Equal(t, []string{id}, again.ids)
			assert.Equal(t, "the token leaked", again.reason)
			assert.Empty(t, r.Select(Selector{CredentialID: id}), "a revoked grant is live again")
			assert.True(t, r.Revoked(id))
		})
	}
}
