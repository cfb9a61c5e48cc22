package e2e

import (
	"context"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"

	"github.com/credbroker/credbroker/pkg/broker"
	"github.com/credbroker/credbroker/pkg/plugin"
	"github.com/credbroker/credbroker/pkg/publish"
	"github.com/credbroker/credbroker/test/framework"
)

// statusWrites counts the PATCH requests a broker sends to
// clusterprofiles/status.
type statusWrites struct {
	next  http.RoundTripper
	count atomic.Int32
}

func (w *statusWrites) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Method == http.MethodPatch && strings.Contains(req.URL.Path, "/clusterprofiles/") && strings.HasSuffix(req.URL.Path, "/status") {
		w.count.Add(1)
	}
	return w.next.RoundTrip(req)
}

// Two publishing replicas share a Lease: only its holder writes
// ClusterProfile status. When the holder stops, the Lease moves to the
// other replica, the published entry stays as it was (no write is needed),
// and the new holder is the one that writes the next change.
func TestOnlyTheLeaseHolderPublishes(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	name := uniqueName(t, "replicas")
	profiles := env.Hub.Inventory.ApisV1alpha1().ClusterProfiles(framework.FleetNamespace)
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, nil)
	require.NoError(t, err)

	type replica struct {
		b      *broker.Broker
		writes *statusWrites
		stop   func()
	}
	replicas := map[string]*replica{}
	for _, id := range []string{"replica-a", "replica-b"} {
		writes := &statusWrites{}
		b, stop := startPublisher(t, name, id, func(cfg *broker.Config) {
			cfg.Hub = rest.CopyConfig(cfg.Hub)
			cfg.Hub.WrapTransport = func(rt http.RoundTripper) http.RoundTripper { writes.next = rt; return writes }
		})
		replicas[id] = &replica{b: b, writes: writes, stop: stop}
	}
	brokers := make([]*broker.Broker, 0, len(replicas))
	for _, r := range replicas {
		brokers = append(brokers, r.b)
	}
	stopAgent := startAdvertisingAgent(t, spoke, name, brokers...)

	get := func() *v1alpha1.ClusterProfile {
		cp, err := profiles.Get(ctx, name, metav1.GetOptions{})
		require.NoError(t, err)
		return cp
	}
	connected := func(cp *v1alpha1.ClusterProfile, want metav1.ConditionStatus) bool {
		c := findCondition(cp, publish.ConditionType)
		return findProvider(cp, plugin.Name) != nil && c != nil && c.Status == want
	}
	holder := func() string {
		lease, err := env.Hub.Client.CoordinationV1().Leases("default").Get(ctx, name, metav1.GetOptions{})
		if err != nil || lease.Spec.HolderIdentity == nil {
			return ""
		}
		return *lease.Spec.HolderIdentity
	}
	framework.Eventually(t, 30*time.Second, 100*time.Millisecond, "the replicas to publish the access provider", func(c assert.TestingT) {
		cp := get()
		assert.True(c, connected(cp, metav1.ConditionTrue), "%s provider and %s=True in %s", plugin.Name, publish.ConditionType, statusOf(cp))
	})
	published := get()

	leader := holder()
	require.Contains(t, replicas, leader)
	follower := "replica-a"
	if leader == follower {
		follower = "replica-b"
	}
	assert.Positive(t, replicas[leader].writes.count.Load(), "the Lease holder wrote nothing")
	assert.Zero(t, replicas[follower].writes.count.Load(), "the replica without the Lease wrote status")

	// The holder stops (it releases the Lease on the way out).
	replicas[leader].stop()
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Equal(c, follower, holder(), "the holder of Lease default/%s", name) },
		30*time.Second, 100*time.Millisecond, "the Lease moves to the other replica")
	// The entry stays: the new holder finds nothing to change.
	time.Sleep(time.Second)
	now := get()
	assert.True(t, connected(now, metav1.ConditionTrue))
	assert.Equal(t, findProvider(published, plugin.Name), findProvider(now, plugin.Name))
	assert.Equal(t, published.ResourceVersion, now.ResourceVersion, "the new holder rewrote an unchanged status")

	// The next change is the new holder's to write.
	stopAgent()
	framework.Eventually(t, 30*time.Second, 100*time.Millisecond, "the new holder to turn the condition False when the agent goes", func(c assert.TestingT) {
		cp := get()
		assert.True(c, connected(cp, metav1.ConditionFalse), "%s provider and %s=False in %s", plugin.Name, publish.ConditionType, statusOf(cp))
	})
	assert.Positive(t, replicas[follower].writes.count.Load(), "the new Lease holder wrote nothing")
}
