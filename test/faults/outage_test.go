package faults

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/credbroker/credbroker/test/framework"
)

// TestSpokeAPIServerDown takes spoke-1's API server away from its agents
// while consumers ask for tokens, and brings it back. Consumers get
// Unavailable naming the cluster, then tokens again; a ServiceAccount
// created during the outage is served once the agents' informers resync,
// without restarting anything.
func TestSpokeAPIServerDown(t *testing.T) {
	c := newCaller(t, 4, spoke1)
	waitFor(t, 30*time.Second, "both agents of spoke-1", func(c assert.TestingT) { assertConnected(c, spoke1, 2) })
	_, _, err := c.exchange(spoke1, 0, mintTimeout)
	require.NoError(t, err)

	spokeProxy.Down()
	t.Cleanup(spokeProxy.Heal)
	down := time.Now()
	// Consumers keep asking for a few seconds, long enough for the agents'
	// watches to break and their reconnects to fail.
	for i := 1; time.Since(down) < 3*time.Second; i = 3 - i {
		code, took, err := c.exchange(spoke1, i, 2*mintTimeout)
		require.Equal(t, codes.Unavailable, code, "%v", err)
		require.ErrorContains(t, err, framework.FleetNamespace+"/"+spoke1.Name, "the message names the cluster")
		require.Less(t, took, mintTimeout, "a refused connection fails fast")
		if time.Since(down) < 200*time.Millisecond {
			t.Logf("spoke down: %s after %s", err, took.Round(time.Millisecond))
		}
		time.Sleep(100 * time.Millisecond) // pacing, not synchronization
	}
	// Created while the agents cannot see it.
	require.NoError(t, spoke1.EnsureNamespace(t.Context(), c.targetNS))
	_, err = spoke1.CreateServiceAccount(t.Context(), c.targetNS, "created-during-outage",
		map[string]string{"credbroker.io/allowed-subjects": c.Username()})
	require.NoError(t, err)
	c.targets[spoke1.Name] = append(c.targets[spoke1.Name], "created-during-outage")
	requireNoPendingMints(t)

	spokeProxy.Heal()
	healed := time.Now()
	recovered := waitFor(t, 2*time.Minute, "spoke-1 to serve again", func(ct assert.TestingT) {
		c.assertServes(ct, spoke1, 3, mintTimeout)
	})
	resynced := waitFor(t, 2*time.Minute, "the ServiceAccount created during the outage", func(ct assert.TestingT) {
		c.assertServes(ct, spoke1, len(c.targets[spoke1.Name])-1, mintTimeout)
	})
	t.Logf("spoke down for %s; served again %s after it came back, the ServiceAccount created meanwhile %s after",
		healed.Sub(down).Round(10*time.Millisecond), recovered.Round(10*time.Millisecond), (recovered + resynced).Round(10*time.Millisecond))
	requireNoPendingMints(t)
}

// TestHubAPIServerDown takes the hub away from the broker. New consumers
// fail closed with Unavailable; a consumer whose decisions are cached is
// served until they expire, and then refused; the ClusterProfile informer
// keeps its last view, and once the hub is back it sees a ClusterProfile
// deleted during the outage, which is then served no more.
func TestHubAPIServerDown(t *testing.T) {
	ctx := t.Context()
	known := newCaller(t, 3, spoke1, spoke2)
	waitFor(t, 30*time.Second, "the agents", func(c assert.TestingT) { assertConnected(c, spoke1, 2); assertConnected(c, spoke2, 1) })
	late, err := env.NewConsumer(ctx, unique("hub"), "late", "credbroker", spoke1.Name)
	require.NoError(t, err)
	lateCaller := &caller{Consumer: late, client: known.client, targetNS: known.targetNS, targets: known.targets}
	_, _, err = known.exchange(spoke1, 0, mintTimeout)
	require.NoError(t, err)
	_, _, err = known.exchange(spoke2, 0, mintTimeout)
	require.NoError(t, err)
	cached := time.Now()

	hubProxy.Down()
	t.Cleanup(hubProxy.Heal)
	code, took, err := lateCaller.exchange(spoke1, 0, 2*mintTimeout)
	require.Equal(t, codes.Unavailable, code, "a consumer never seen before fails closed: %v", err)
	t.Logf("hub down: a new consumer got %s after %s", err, took.Round(time.Millisecond))

	// Decisions cached before the outage still hold, and the informer's
	// last view still serves: a new mint for a known consumer.
	require.Less(t, time.Since(cached), decisionTTL/2, "the machine is too slow for this test's decision TTL")
	_, _, err = known.exchange(spoke1, 1, mintTimeout)
	require.NoError(t, err, "a cached decision is honoured while it lasts")
	// Deleted while the broker cannot see it.
	cp, err := env.Hub.Inventory.ApisV1alpha1().ClusterProfiles(framework.FleetNamespace).Get(ctx, spoke2.Name, metav1.GetOptions{})
	require.NoError(t, err)
	require.NoError(t, env.Hub.Inventory.ApisV1alpha1().ClusterProfiles(framework.FleetNamespace).Delete(ctx, spoke2.Name, metav1.DeleteOptions{}))
	t.Cleanup(func() { restoreClusterProfile(t, cp.Name) })

	waitFor(t, 2*decisionTTL, "the cached decisions to expire", func(c assert.TestingT) {
		code, _, err := known.exchange(spoke1, 2, mintTimeout)
		assert.Equal(c, codes.Unavailable, code, "the known consumer's exchange: %v", err)
	})
	t.Logf("hub down: the known consumer was refused %s after its decisions were cached (TTL %s)",
		time.Since(cached).Round(10*time.Millisecond), decisionTTL)

	hubProxy.Heal()
	seen := waitFor(t, time.Minute, "the broker to see the deletion", func(c assert.TestingT) { assertConnected(c, spoke2, 0) })
	code, _, err = known.exchange(spoke2, 1, mintTimeout)
	require.Equal(t, codes.NotFound, code, "no exchange for a ClusterProfile deleted during the outage: %v", err)
	recovered := waitFor(t, time.Minute, "the hub to serve the broker again", func(c assert.TestingT) {
		known.assertServes(c, spoke1, 2, mintTimeout)
	})
	t.Logf("hub back: deletion seen after %s; exchanges served again after %s", seen.Round(10*time.Millisecond), (seen + recovered).Round(10*time.Millisecond))
	requireNoPendingMints(t)
}

// restoreClusterProfile recreates a deleted ClusterProfile of the
// deployment and waits until its agent serves it again.
func restoreClusterProfile(t *testing.T, name string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	spoke := spoke2
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, deployment.ProfileAccess(spoke, framework.FleetNamespace, name))
	if err != nil && !apierrors.IsAlreadyExists(err) {
		t.Errorf("recreate ClusterProfile %s: %v", name, err)
		return
	}
	// t.Context is done by now: poll under ctx.
	var last int
	if err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		last = connected(spoke)
		return last == 1, nil
	}); err != nil {
		t.Errorf("the agent does not serve the recreated ClusterProfile %s (last seen %d streams): %v", name, last, err)
	}
}
