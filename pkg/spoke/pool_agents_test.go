package spoke

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/client-go/tools/cache"
	testingclock "k8s.io/utils/clock/testing"
)

// The agents of a spoke are a DaemonSet: every replica watches every grant
// of the spoke and judges every change it sees (tamper.go). A claim is a
// change that only the replica that made it wrote.

// fanOut calls every one of its handlers, as each replica's informer would.
type fanOut []cache.ResourceEventHandler

func (f fanOut) OnAdd(obj any, initial bool) {
	for _, h := range f {
		h.OnAdd(obj, initial)
	}
}

func (f fanOut) OnUpdate(old, now any) {
	for _, h := range f {
		h.OnUpdate(old, now)
	}
}

func (f fanOut) OnDelete(obj any) {
	for _, h := range f {
		h.OnDelete(obj)
	}
}

// replicas returns two agents of one spoke, with pools of two, writing
// grants through store and both told of every change to grants, running
// until the test ends.
func replicas(t *testing.T, tokens TokenCreator, grants *fakeGrants, store GrantStore) []*Minter {
	t.Helper()
	sas := lister(t, serviceAccount("apps", "deployer", argocd))
	var agents []*Minter
	var handlers fanOut
	for range 2 {
		m, err := New(Config{Tokens: tokens, ServiceAccounts: sas, Grants: store, GrantCache: grants.cache, PoolSize: 2,
			Clock: testingclock.NewFakeClock(issuedAt)})
		require.NoError(t, err)
		agents = append(agents, m)
		handlers = append(handlers, m.GrantEvents())
	}
	grants.mu.Lock()
	grants.events = handlers
	grants.mu.Unlock()
	for _, m := range agents {
		startRun(t, m, grants, m.clock.(*testingclock.FakeClock))
	}
	return agents
}

// Agent A claims one of its pooled grants for a consumer's token; agent B,
// another replica of the same spoke, sees the claim. Without telling a
// claim of a grant it did not pool from a change to one it did, B took
// A's claim for a change by someone else and deleted the grant, which
// revoked the token A had just answered with.
func TestAnotherAgentsClaimIsNotRevoked(t *testing.T) {
	tokens, grants := &fakeTokens{}, newFakeGrants()
	agents := replicas(t, tokens, grants, grants)
	a := agents[0]
	fillPool(t, a, grants, deployerRequest())

	_, err := a.Mint(t.Context(), poolCluster, deployerRequest())
	require.NoError(t, err)
	key, uid := boundTo(t, tokens, 1)
	require.Eventually(t, func() bool { g := grants.Get(key); return g == nil || !unclaimed(g) }, 5*time.Second, time.Millisecond,
		"the grant was never claimed")
	assert.Never(t, func() bool { g := grants.Get(key); return g == nil || g.UID != uid }, 200*time.Millisecond, time.Millisecond,
		"another agent of the spoke deleted the grant that agent A claimed, which revoked the token A answered")
	_, changed := agents[1].changedRecord(uid)
	assert.False(t, changed, "another agent took A's claim for a change by someone else")
}

// The agent stops (a rollout, a drain) while the claim of a token it has
// answered is still on its way to the API server. Once Run returns, the
// agent's process exits: a claim still in flight then never lands, and the
// token lives unattributed, and unrevocable by its credential id, until
// the sweep of another agent collects its pooled grant. Without waiting
// for its claims, Run returned with the grant neither claimed nor deleted.
func TestRunReturnsOnlyOnceItsClaimsLanded(t *testing.T) {
	tokens, grants := &fakeTokens{}, newFakeGrants()
	gated := &gatedGrants{fakeGrants: grants}
	clk := testingclock.NewFakeClock(issuedAt)
	m, err := New(Config{Tokens: tokens, ServiceAccounts: lister(t, serviceAccount("apps", "deployer", argocd)),
		Grants: gated, GrantCache: grants.cache, PoolSize: 2, Clock: clk})
	require.NoError(t, err)
	grants.mu.Lock()
	grants.events = m.GrantEvents()
	grants.mu.Unlock()
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	require.Eventually(t, func() bool { return grants.Lists() >= 1 && clk.HasWaiters() }, 5*time.Second, time.Millisecond)
	fillPool(t, m, grants, deployerRequest())
	gated.hold()
	_, err = m.Mint(t.Context(), poolCluster, deployerRequest())
	require.NoError(t, err)
	key, uid := boundTo(t, tokens, 1)

	cancel()
	time.AfterFunc(100*time.Millisecond, gated.let)
	require.NoError(t, <-done)
	g := grants.Get(key)
	assert.True(t, g == nil || g.UID != uid || !unclaimed(g),
		"Run returned while the claim of an answered token was in flight: the token would live unattributed")
}
