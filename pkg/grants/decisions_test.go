package grants

import (
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// recordingDecisions records what the triggers told it.
type recordingDecisions struct {
	mu       sync.Mutex
	rbac     int
	subjects []string
}

func (d *recordingDecisions) RBACChanged() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.rbac++
}

func (d *recordingDecisions) SubjectChanged(username string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.subjects = append(d.subjects, username)
}

func (d *recordingDecisions) told() (int, []string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.rbac, slices.Clone(d.subjects)
}

// Attack: a trigger revokes a consumer's grants after a change of hub RBAC
// or of its hub ServiceAccount, and the consumer's next exchange, on the
// leading replica or another, is served from a decision cached before the
// change and mints a new grant.
// Defence: every replica's triggers, leading or not (no Run here), tell
// its Decisions of each change as their informers see it; informers' first
// list and resyncs are not changes.
func TestEveryReplicaForgetsDecisionsOnChange(t *testing.T) {
	f := newFixture(t)
	d := &recordingDecisions{}
	f.triggers.cfg.Decisions = d

	f.rbac.add(role("1"), true)
	f.rbac.update(role("1"), role("1"))
	f.accounts.add(serviceAccount("team-c", "carl", "carl-uid"), true)
	n, subjects := d.told()
	assert.Zero(t, n, "an informer's first list or resync changes nothing")
	assert.Empty(t, subjects)

	f.rbac.update(role("1"), role("2"))
	f.rbac.remove(role("2"))
	f.rbac.add(role("3"), false)
	f.accounts.remove(serviceAccount("team-a", "alice", "alice-uid"))
	f.accounts.add(serviceAccount("team-a", "alice", "alice-uid-2"), false)
	n, subjects = d.told()
	assert.Equal(t, 3, n)
	assert.Equal(t, []string{alice, alice}, subjects)
}

// Attack: a replica whose informer sees a hub ServiceAccount's deletion
// later than the leader's mints a grant for it from its cached
// TokenReview after the leader has checked that account's grants.
// Defence: the leader checks a changed account's grants again, Debounce
// after the first check.
func TestChangedAccountsAreCheckedAgain(t *testing.T) {
	f := newFixture(t)
	f.run(t)
	f.accounts.remove(serviceAccount("team-a", "alice", "alice-uid"))
	require.Eventually(t, func() bool { return len(f.revoker.revokedIDs()) == 3 }, 10*time.Second, time.Millisecond)

	// Another replica mints for alice meanwhile; its grant reaches this
	// one's registry.
	require.NoError(t, f.registry.Report(t.Context(), spoke1, &pb.GrantUpdate{Added: []*pb.Grant{subjectGrant("JTI=late", spoke1, alice, "alice-uid")}}))
	went := f.stepUntil(t, 100*time.Millisecond, 5*time.Second, func() bool {
		return slices.Contains(f.revoker.revokedIDs(), "JTI=late")
	})
	assert.GreaterOrEqual(t, went, 2*time.Second, "checked again no sooner than Debounce after the first check")
	assert.NotContains(t, f.live(), "JTI=late")
}
