package e2e

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// claimant creates the ClusterProfile ns/name, pointing at spoke like the
// real one, with its agent ID annotation set to agentID, and deletes it when
// the test ends.
func claimant(t *testing.T, spoke *framework.Cluster, ns, name, agentID string) {
	t.Helper()
	ctx := context.Background()
	_, err := env.Hub.CreateClusterProfile(ctx, ns, name, deployment.ProfileAccess(spoke, ns, name))
	require.NoError(t, err)
	profiles := env.Hub.Inventory.ApisV1alpha1().ClusterProfiles(ns)
	t.Cleanup(func() { _ = profiles.Delete(context.Background(), name, metav1.DeleteOptions{}) })
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{
		"credbroker.io/agent-spiffe-id": agentID,
	}}})
	require.NoError(t, err)
	_, err = profiles.Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{})
	require.NoError(t, err)
}

// holdInTerminating adds a finalizer to the ClusterProfile ns/name and
// deletes it, so it stays Terminating until the test ends.
func holdInTerminating(t *testing.T, ns, name string) {
	t.Helper()
	ctx := context.Background()
	profiles := env.Hub.Inventory.ApisV1alpha1().ClusterProfiles(ns)
	_, err := profiles.Patch(ctx, name, types.MergePatchType, []byte(`{"metadata":{"finalizers":["e2e.credbroker.io/hold"]}}`), metav1.PatchOptions{})
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = profiles.Patch(context.Background(), name, types.MergePatchType, []byte(`{"metadata":{"finalizers":null}}`), metav1.PatchOptions{})
	})
	require.NoError(t, profiles.Delete(ctx, name, metav1.DeleteOptions{}))
	// Every replica must see the deletion before the test goes on.
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		for i, b := range deployment.Brokers {
			assert.Zero(ct, b.Connected(ns, name), "replica %d's agent streams of %s/%s", i, ns, name)
		}
	}, 10*time.Second, 20*time.Millisecond, "the replicas to see the deletion of %s/%s", ns, name)
}

// seen waits until every broker replica knows the ClusterProfile ns/name,
// which is when an exchange for it stops being NotFound.
func seen(t *testing.T, c consumer, ns, name string) {
	t.Helper()
	for _, b := range deployment.Brokers {
		client := exchangeClientAt(t, b.ExchangeAddr())
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			_, err := exchangeVia(t, client, c, &pb.ExchangeRequest{Cluster: &pb.ObjectReference{Namespace: ns, Name: name}, Audiences: []string{"seen"}})
			assert.NotEqual(ct, codes.NotFound, status.Code(err), "an exchange for %s/%s through %s: %v", ns, name, b.ExchangeAddr(), err)
		}, 10*time.Second, 20*time.Millisecond, "the replicas to know ClusterProfile %s/%s", ns, name)
	}
}

// Trust boundary 1: a ClusterProfile cannot claim another cluster's agent.
// other/evil names spoke-0's default agent ID in its annotation. Before the
// fix the broker refused both as ambiguous, cutting spoke-0 off; now the
// annotation is invalid, spoke-0 keeps serving, and other/evil gets no token.
func TestClusterProfileCannotClaimAnotherAgent(t *testing.T) {
	spoke := env.Spokes[0]
	c := newConsumer(t, "credbroker", spoke.Name)
	optInAudiences(t, spoke, "claimed-sa", []string{"seen", "after-claim"}, c.username())

	evil := uniqueName(t, "evil")
	claimant(t, spoke, "other", evil, framework.AgentID(spoke.Name))
	require.NoError(t, env.Hub.GrantClusterProfileToken(context.Background(), "other", evil, c.namespace, c.name))
	seen(t, c, "other", evil)

	for i, b := range deployment.Brokers {
		client := exchangeClientAt(t, b.ExchangeAddr())
		_, err := exchangeVia(t, client, c, &pb.ExchangeRequest{Cluster: &pb.ObjectReference{Namespace: "other", Name: evil}})
		st := status.Convert(err)
		assert.Equal(t, codes.FailedPrecondition, st.Code(), "replica %d: %s", i, st.Message())
		assert.Contains(t, st.Message(), "reserved path /clusterprofile/")

		assert.Equal(t, 1, b.Connected(framework.FleetNamespace, spoke.Name), "replica %d lost spoke-0's agent", i)
		resp, err := exchangeVia(t, client, c, &pb.ExchangeRequest{Cluster: clusterRef(spoke), Audiences: []string{"after-claim"}})
		require.NoError(t, err, "replica %d", i)
		assert.Equal(t, "claimed-sa", resp.GetServiceAccount().GetName())
	}
}

// The same attack while the rightful ClusterProfile is Terminating: before
// the fix, the claimant then mapped uniquely and its consumers got tokens
// from the victim's spoke under RBAC in the claimant's own namespace.
func TestClusterProfileCannotInheritATerminatingAgent(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	victim, heir := uniqueName(t, "victim"), uniqueName(t, "heir")
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, victim, deployment.ProfileAccess(spoke, framework.FleetNamespace, victim))
	require.NoError(t, err)
	stop, err := deployment.StartAgent(ctx, spoke, framework.AgentID(victim))
	require.NoError(t, err)
	defer stop()

	c := newConsumer(t, "credbroker", victim)
	optInAudiences(t, spoke, "victim-sa", []string{"seen"}, c.username())
	_, err = exchange(t, c, &pb.ExchangeRequest{Cluster: &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: victim}})
	require.NoError(t, err, "the victim serves before the attack")

	claimant(t, spoke, "other", heir, framework.AgentID(victim))
	require.NoError(t, env.Hub.GrantClusterProfileToken(ctx, "other", heir, c.namespace, c.name))
	seen(t, c, "other", heir)
	holdInTerminating(t, framework.FleetNamespace, victim)

	// The agent keeps reconnecting; give it time to be admitted for the
	// claimant if the broker would.
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		for i, b := range deployment.Brokers {
			assert.Zero(t, b.Connected("other", heir), "replica %d handed the victim's agent to other/heir", i)
			_, err := exchangeVia(t, exchangeClientAt(t, b.ExchangeAddr()), c, &pb.ExchangeRequest{Cluster: &pb.ObjectReference{Namespace: "other", Name: heir}})
			require.Error(t, err, "replica %d gave other/heir a token from the victim's spoke", i)
			assert.Equal(t, codes.FailedPrecondition, status.Code(err), "replica %d: %v", i, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
