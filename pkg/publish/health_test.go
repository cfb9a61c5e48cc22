package publish

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"
)

func keepHealth(c *Config) { c.ControlPlaneHealthy = true }

// healthOf returns the ControlPlaneHealthy condition of the fake hub's
// ClusterProfile, or nil.
func healthOf(hub *fakeHub) *metav1.Condition { return findCondition(hub.cp, HealthConditionType) }

// The condition follows what the agents report, in the order a spoke
// lives through: it comes up, it fails, it recovers, its agent goes.
func TestControlPlaneHealthyFollowsTheAgents(t *testing.T) {
	ctx := context.Background()
	p, src, hub, clk := newFixture(t, keepHealth)
	src.server, src.ca = "https://spoke:6443", []byte("ca")
	steps := []struct {
		name   string
		live   int
		ready  Readiness
		status metav1.ConditionStatus
		reason string
		writes int
	}{
		{"agents that report nothing", 1, Readiness{}, metav1.ConditionUnknown, ReasonNotReported, 1},
		{"a ready spoke", 1, Readiness{Ready: 1}, metav1.ConditionTrue, ReasonSpokeReady, 2},
		{"no change, no write", 2, Readiness{Ready: 2}, metav1.ConditionTrue, ReasonSpokeReady, 2},
		{"one agent of two sees it ready", 2, Readiness{Ready: 1, NotReady: 1, Message: "etcd"}, metav1.ConditionTrue, ReasonSpokeReady, 2},
		{"a spoke that is not ready", 1, Readiness{NotReady: 1, Message: "[-]etcd failed"}, metav1.ConditionFalse, ReasonSpokeNotReady, 3},
		{"it recovers", 1, Readiness{Ready: 1}, metav1.ConditionTrue, ReasonSpokeReady, 4},
	}
	var transitions []metav1.Time
	for _, s := range steps {
		src.live, src.ready = s.live, s.ready
		clk.Step(time.Second)
		_, err := p.Reconcile(ctx, key)
		require.NoError(t, err, s.name)
		c := healthOf(hub)
		require.NotNil(t, c, s.name)
		assert.Equal(t, s.status, c.Status, s.name)
		assert.Equal(t, s.reason, c.Reason, s.name)
		assert.Equal(t, s.writes, hub.writes, s.name)
		transitions = append(transitions, c.LastTransitionTime)
	}
	assert.Contains(t, healthOf(hub).Message, "answers ok")
	assert.Equal(t, transitions[1], transitions[3], "the transition time moves only when the status does")

	// Not ready: the agents' reason reaches the message.
	src.ready = Readiness{NotReady: 1, Message: "/readyz reports [-]etcd failed: reason withheld"}
	_, err := p.Reconcile(ctx, key)
	require.NoError(t, err)
	assert.Contains(t, healthOf(hub).Message, "[-]etcd failed")

	// The agent goes: False once the grace is over, with the other
	// condition.
	src.live, src.ready = 0, Readiness{}
	after, err := p.Reconcile(ctx, key)
	require.NoError(t, err)
	require.Positive(t, after)
	assert.Equal(t, ReasonSpokeNotReady, healthOf(hub).Reason, "nothing changes within the grace")
	clk.Step(after)
	_, err = p.Reconcile(ctx, key)
	require.NoError(t, err)
	assert.Equal(t, metav1.ConditionFalse, healthOf(hub).Status)
	assert.Equal(t, ReasonNoAgentConnected, healthOf(hub).Reason)
}

// Where another field manager owns ControlPlaneHealthy, such as the
// cluster manager, the publisher never writes it, and gives up its own
// when another manager takes it over.
func TestControlPlaneHealthyDefersToAnotherWriter(t *testing.T) {
	ctx := context.Background()
	managers := []struct {
		name string
		op   metav1.ManagedFieldsOperationType
	}{
		{"cluster-manager", metav1.ManagedFieldsOperationUpdate},
		{"ocm-registration", metav1.ManagedFieldsOperationApply},
		// The broker's own name, written by Update, is not the publisher.
		{testManager, metav1.ManagedFieldsOperationUpdate},
	}
	for _, m := range managers {
		t.Run(m.name+"/"+string(m.op), func(t *testing.T) {
			p, src, hub, _ := newFixture(t, keepHealth)
			src.server, src.ca, src.live, src.ready = "https://spoke:6443", []byte("ca"), 1, Readiness{Ready: 1}
			theirs := metav1.Condition{Type: HealthConditionType, Status: metav1.ConditionFalse, Reason: "ManagerSaysNo", Message: "from the manager"}
			hub.cp.Status.Conditions = []metav1.Condition{theirs}
			hub.cp.ManagedFields = []metav1.ManagedFieldsEntry{conditionOwner(m.name, m.op, HealthConditionType)}

			_, err := p.Reconcile(ctx, key)
			require.NoError(t, err)
			assert.Equal(t, 1, hub.writes, "the broker's own condition is written")
			assert.Equal(t, "from the manager", healthOf(hub).Message, "the manager's ControlPlaneHealthy is left alone")
			_, ours := conditionManagers(hub.cp, HealthConditionType, testManager)
			assert.False(t, ours)
		})
	}

	t.Run("taken over", func(t *testing.T) {
		p, src, hub, _ := newFixture(t, keepHealth)
		src.server, src.ca, src.live, src.ready = "https://spoke:6443", []byte("ca"), 1, Readiness{Ready: 1}
		_, err := p.Reconcile(ctx, key)
		require.NoError(t, err)
		require.Equal(t, metav1.ConditionTrue, healthOf(hub).Status)

		// A cluster manager starts to write it too.
		hub.cp.ManagedFields = append(hub.cp.ManagedFields, conditionOwner("cluster-manager", metav1.ManagedFieldsOperationUpdate, HealthConditionType))
		_, err = p.Reconcile(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, 2, hub.writes, "the publisher applies once more, without the condition")
		_, ours := conditionManagers(hub.cp, HealthConditionType, testManager)
		assert.False(t, ours, "and so gives it up")
		assert.NotNil(t, healthOf(hub), "the manager's copy stays")
	})
}

// Without ControlPlaneHealthy the publisher writes no such condition, and
// drops the one it kept when it was on.
func TestControlPlaneHealthyIsOptIn(t *testing.T) {
	ctx := context.Background()
	p, src, hub, _ := newFixture(t)
	src.server, src.ca, src.live, src.ready = "https://spoke:6443", []byte("ca"), 1, Readiness{Ready: 1}
	_, err := p.Reconcile(ctx, key)
	require.NoError(t, err)
	assert.Nil(t, healthOf(hub))

	// It was on before: the publisher's condition goes.
	hub.cp.Status.Conditions = append(hub.cp.Status.Conditions, metav1.Condition{Type: HealthConditionType, Status: metav1.ConditionTrue, Reason: ReasonSpokeReady})
	hub.cp.ManagedFields = []metav1.ManagedFieldsEntry{conditionOwner(testManager, metav1.ManagedFieldsOperationApply, ConditionType, HealthConditionType)}
	_, err = p.Reconcile(ctx, key)
	require.NoError(t, err)
	assert.Nil(t, healthOf(hub))
	assert.NotNil(t, findCondition(hub.cp, ConditionType))

	_, err = New(Config{ProviderName: "x", Source: src, Get: p.cfg.Get, Apply: p.cfg.Apply, ControlPlaneHealthy: true})
	assert.ErrorContains(t, err, "field manager")
}

func TestConditionManagers(t *testing.T) {
	cases := []struct {
		name   string
		fields string
		owned  bool
	}{
		{"no status", `{"f:metadata":{}}`, false},
		{"another condition", `{"f:status":{"f:conditions":{"k:{\"type\":\"Joined\"}":{}}}}`, false},
		{"the condition", `{"f:status":{"f:conditions":{"k:{\"type\":\"ControlPlaneHealthy\"}":{".":{}}}}}`, true},
		{"not JSON", `{"f:status":`, false},
		{"conditions not a set", `{"f:status":{"f:conditions":[]}}`, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cp := &v1alpha1.ClusterProfile{ObjectMeta: metav1.ObjectMeta{ManagedFields: []metav1.ManagedFieldsEntry{
				{Manager: "cluster-manager", Operation: metav1.ManagedFieldsOperationUpdate, FieldsV1: &metav1.FieldsV1{Raw: []byte(c.fields)}},
				{Manager: testManager, Operation: metav1.ManagedFieldsOperationApply, FieldsV1: &metav1.FieldsV1{Raw: []byte(c.fields)}},
				{Manager: "no-fields"},
			}}}
			others, ours := conditionManagers(cp, HealthConditionType, testManager)
			assert.Equal(t, c.owned, others)
			assert.Equal(t, c.owned, ours, "the same fields, written by the publisher")
		})
	}
}
