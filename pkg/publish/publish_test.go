package publish

import (
	"context"
	"encoding/json"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	clocktesting "k8s.io/utils/clock/testing"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"
)

// fakeSource reports live streams that all advertise server and ca, or,
// when ads is set, those advertisements.
type fakeSource struct {
	server string
	ca     []byte
	live   int
	ads    []Advertisement
	ready  Readiness
}

func (f *fakeSource) SpokeReadiness(types.NamespacedName) Readiness { return f.ready }

func (f *fakeSource) Advertised(types.NamespacedName) ([]Advertisement, int) {
	if f.ads != nil {
		return f.ads, f.live
	}
	if f.server == "" {
		return nil, f.live
	}
	return []Advertisement{{Server: f.server, CAData: f.ca, Streams: f.live}}, f.live
}

// fakeHub applies the body's entry and conditions to its ClusterProfile by
// key, as server-side apply with map lists does, and counts the writes. It
// records the conditions the body holds as owned by testManager, and drops
// a condition that manager owned and the body leaves out (as server-side
// apply does when no other manager owns it).
type fakeHub struct {
	cp     *v1alpha1.ClusterProfile
	writes int
}

const testManager = "credbroker-broker"

func (h *fakeHub) apply(_ context.Context, _ types.NamespacedName, body []byte) error {
	h.writes++
	var b applyBody
	if err := json.Unmarshal(body, &b); err != nil {
		return err
	}
	for _, e := range b.Status.AccessProviders {
		h.cp.Status.AccessProviders = upsert(h.cp.Status.AccessProviders, e, func(x v1alpha1.AccessProvider) bool { return x.Name == e.Name })
	}
	applied := map[string]bool{}
	for _, c := range b.Status.Conditions {
		applied[c.Type] = true
		h.cp.Status.Conditions = upsert(h.cp.Status.Conditions, c, func(x metav1.Condition) bool { return x.Type == c.Type })
	}
	h.cp.Status.Conditions = slices.DeleteFunc(h.cp.Status.Conditions, func(c metav1.Condition) bool {
		others, ours := conditionManagers(h.cp, c.Type, testManager)
		return ours && !others && !applied[c.Type]
	})
	h.cp.ManagedFields = slices.DeleteFunc(h.cp.ManagedFields, func(mf metav1.ManagedFieldsEntry) bool { return mf.Manager == testManager })
	h.cp.ManagedFields = append(h.cp.ManagedFields, conditionOwner(testManager, metav1.ManagedFieldsOperationApply, slices.Collect(maps.Keys(applied))...))
	return nil
}

// conditionOwner is a managedFields entry of manager that owns the
// conditions of types.
func conditionOwner(manager string, op metav1.ManagedFieldsOperationType, types ...string) metav1.ManagedFieldsEntry {
	conds := map[string]any{}
	for _, t := range types {
		key, _ := json.Marshal(map[string]string{"type": t})
		conds["k:"+string(key)] = map[string]any{".": map[string]any{}, "f:status": map[string]any{}}
	}
	raw, _ := json.Marshal(map[string]any{"f:status": map[string]any{"f:conditions": conds}})
	return metav1.ManagedFieldsEntry{Manager: manager, Operation: op, Subresource: "status", FieldsType: "FieldsV1", FieldsV1: &metav1.FieldsV1{Raw: raw}}
}

func upsert[T any](list []T, v T, same func(T) bool) []T {
	for i := range list {
		if same(list[i]) {
			list[i] = v
			return list
		}
	}
	return append(list, v)
}

var key = types.NamespacedName{Namespace: "fleet", Name: "prod"}

// newFixture returns a publisher of a fake hub's ClusterProfile key, with
// what tune changes in its Config.
func newFixture(t *testing.T, tune ...func(*Config)) (*Publisher, *fakeSource, *fakeHub, *clocktesting.FakeClock) {
	t.Helper()
	src := &fakeSource{}
	hub := &fakeHub{cp: &v1alpha1.ClusterProfile{ObjectMeta: metav1.ObjectMeta{Namespace: key.Namespace, Name: key.Name, Generation: 1}}}
	clk := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
	cfg := Config{
		ProviderName: "credbroker", Source: src, Clock: clk, DisconnectGrace: 30 * time.Second,
		Get:          func(types.NamespacedName) (*v1alpha1.ClusterProfile, error) { return hub.cp.DeepCopy(), nil },
		Apply:        hub.apply,
		FieldManager: testManager,
	}
	for _, fn := range tune {
		fn(&cfg)
	}
	p, err := New(cfg)
	require.NoError(t, err)
	return p, src, hub, clk
}

func TestReconcileWritesOnlyOnChange(t *testing.T) {
	ctx := context.Background()
	p, src, hub, clk := newFixture(t)

	_, err := p.Reconcile(ctx, key)
	require.NoError(t, err)
	assert.Zero(t, hub.writes, "a ClusterProfile that never had an agent is left alone")

	src.server, src.ca, src.live = "https://spoke:6443", []byte("ca"), 2
	for range 3 {
		_, err = p.Reconcile(ctx, key)
		require.NoError(t, err)
	}
	assert.Equal(t, 1, hub.writes, "one write for one change")
	require.Len(t, hub.cp.Status.AccessProviders, 1)
	assert.Equal(t, "https://spoke:6443", hub.cp.Status.AccessProviders[0].Cluster.Server)

	src.live = 1 // fewer streams is no change to publish
	_, err = p.Reconcile(ctx, key)
	require.NoError(t, err)
	assert.Equal(t, 1, hub.writes)

	// Agents that advertise another server change the condition's
	// message, not the published server.
	src.server = "https://spoke-new:6443"
	_, err = p.Reconcile(ctx, key)
	require.NoError(t, err)
	assert.Equal(t, 2, hub.writes, "the condition says the agents disagree")
	assert.Equal(t, "https://spoke:6443", hub.cp.Status.AccessProviders[0].Cluster.Server, "the published server is pinned")
	assert.Contains(t, hub.cp.Status.Conditions[0].Message, "disagree")

	// The agent goes: nothing within the grace, then False once.
	src.server, src.ca, src.live = "", nil, 0
	after, err := p.Reconcile(ctx, key)
	require.NoError(t, err)
	assert.Equal(t, 30*time.Second, after)
	assert.Equal(t, 2, hub.writes, "no write within the grace")
	clk.Step(30 * time.Second)
	for range 3 {
		after, err = p.Reconcile(ctx, key)
		require.NoError(t, err)
		assert.Zero(t, after)
	}
	assert.Equal(t, 3, hub.writes)
	require.Len(t, hub.cp.Status.Conditions, 1)
	assert.Equal(t, metav1.ConditionFalse, hub.cp.Status.Conditions[0].Status)
	assert.Equal(t, ReasonNoAgentConnected, hub.cp.Status.Conditions[0].Reason)
	assert.Equal(t, "https://spoke:6443", hub.cp.Status.AccessProviders[0].Cluster.Server, "the last entry stays")
}

func TestReconcileAgentBackWithinGraceWritesNothing(t *testing.T) {
	ctx := context.Background()
	p, src, hub, clk := newFixture(t)
	src.server, src.live = "https://spoke:6443", 1
	_, err := p.Reconcile(ctx, key)
	require.NoError(t, err)
	src.live = 0
	_, err = p.Reconcile(ctx, key)
	require.NoError(t, err)
	clk.Step(10 * time.Second)
	src.live = 1
	_, err = p.Reconcile(ctx, key)
	require.NoError(t, err)
	clk.Step(time.Minute)
	_, err = p.Reconcile(ctx, key)
	require.NoError(t, err)
	assert.Equal(t, 1, hub.writes)
}

// countingLimiter is a rate limiter that counts the requests it paces.
type countingLimiter struct {
	mu           sync.Mutex
	when, forget int
}

func (c *countingLimiter) When(types.NamespacedName) time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.when++
	return 0
}

func (c *countingLimiter) Forget(types.NamespacedName) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.forget++
}

func (c *countingLimiter) NumRequeues(types.NamespacedName) int { return 0 }

func (c *countingLimiter) counts() (int, int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.when, c.forget
}

func TestRunPacesEveryEnqueueThroughTheLimiter(t *testing.T) {
	p, src, hub, _ := newFixture(t)
	lim := &countingLimiter{}
	p.cfg.RateLimiter = lim
	src.server, src.live = "https://spoke:6443", 1
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); p.Run(ctx, []types.NamespacedName{key}) }()
	require.Eventually(t, func() bool { _, f := lim.counts(); return f >= 1 }, 10*time.Second, time.Millisecond)
	for range 50 {
		p.Enqueue(key)
	}
	cancel()
	<-done
	when, _ := lim.counts()
	assert.GreaterOrEqual(t, when, 2, "every add goes through the rate limiter")
	assert.Equal(t, 1, hub.writes, "a burst of events for an unchanged ClusterProfile writes once")
}
