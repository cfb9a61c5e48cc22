package faults

import (
	"context"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/credbroker/credbroker/internal/testing/faultproxy"
	"github.com/credbroker/credbroker/pkg/agent"
	"github.com/credbroker/credbroker/pkg/grants"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// TestAcknowledgedRevokeSurvivesReplicaKill is the attack on an explicit
// revoke that only one replica remembers. The only agent of a ClusterProfile
// is cut off from both broker replicas: replica A, the shipped broker
// binary, and replica B, in process. The consumer revokes its own token
// through A, which answers that the revoke is pending, and A is SIGKILLed
// at once. When the agent's partition ends, replica B must revoke the
// token: the spoke refuses it within 20 s of the agent's return.
func TestAcknowledgedRevokeSurvivesReplicaKill(t *testing.T) {
	ctx := t.Context()
	profile := unique("durable")
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, profile, deployment.ProfileAccess(spoke2, framework.FleetNamespace, profile))
	require.NoError(t, err)
	cluster := &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: profile}

	// Replica A, the broker binary.
	optsA := replicaOptions(t)
	replicaA, err := deployment.StartBrokerProcess(optsA)
	require.NoError(t, err)
	t.Cleanup(replicaA.Stop)
	replicaB := deployment.Broker

	// The profile's one agent reaches each replica through a proxy of its own.
	toA, err := faultproxy.New(optsA.AgentAddress)
	require.NoError(t, err)
	t.Cleanup(func() { _ = toA.Close() })
	toB, err := faultproxy.New(replicaB.AgentAddr())
	require.NoError(t, err)
	t.Cleanup(func() { _ = toB.Close() })
	stop, err := deployment.StartAgentWith(ctx, spoke2, framework.AgentOptions{
		ID: framework.AgentID(profile), Cluster: framework.FleetNamespace + "/" + profile,
		Tune: func(c *agent.Config) {
			c.BrokerAddresses = []string{toA.Addr(), toB.Addr()}
			c.InitialBackoff, c.MaxBackoff = 100*time.Millisecond, time.Second
			c.KeepaliveTimeout = keepaliveTimeout
		},
	})
	require.NoError(t, err)
	t.Cleanup(stop)

	c, err := env.NewConsumer(ctx, unique("hub"), "consumer", "credbroker", profile)
	require.NoError(t, err)
	ns := unique("spoke")
	require.NoError(t, spoke2.EnsureNamespace(ctx, ns))
	require.NoError(t, deployment.OptIn(ctx, spoke2, ns, "target", c.Username()))

	exchangeB, connB, err := deployment.ExchangeClient(replicaB.ExchangeAddr())
	require.NoError(t, err)
	t.Cleanup(func() { _ = connB.Close() })
	_, connA, err := deployment.ExchangeClient(optsA.ExchangeAddress)
	require.NoError(t, err)
	t.Cleanup(func() { _ = connA.Close() })
	grantsA := pb.NewGrantsClient(connA)

	var resp *pb.ExchangeResponse
	waitFor(t, time.Minute, "the agent to serve the new ClusterProfile", func(ct assert.TestingT) {
		callCtx, cancel := context.WithTimeout(c.Context(ctx), 2*mintTimeout)
		defer cancel()
		resp, err = exchangeB.Exchange(callCtx, &pb.ExchangeRequest{
			Cluster: cluster, ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: "target"},
		})
		assert.NoError(ct, err, "an exchange through replica B")
	})
	id := resp.GetCredentialId()
	review, err := spoke2.ReviewToken(ctx, resp.GetToken(), nil)
	require.NoError(t, err)
	require.True(t, review.Authenticated, "the brokered token does not work: %s", review.Error)
	selector := &pb.GrantSelector{CredentialId: id}
	waitFor(t, time.Minute, "replica A to learn the grant from the agent", func(ct assert.TestingT) {
		callCtx, cancel := context.WithTimeout(c.Context(ctx), 2*mintTimeout)
		defer cancel()
		list, err := grantsA.List(callCtx, &pb.ListGrantsRequest{Selector: selector})
		if assert.NoError(ct, err, "ListGrants on replica A") {
			assert.Len(ct, list.GetGrants(), 1, "replica A's grants of %s", id)
		}
	}, replicaA)
	waitFor(t, 30*time.Second, "replica B to know the grant", func(ct assert.TestingT) {
		assert.Len(ct, replicaB.Grants().Select(grants.Selector{CredentialID: id}), 1, "replica B's grants of %s", id)
	})

	// The agent is cut off from both replicas.
	toA.Partition()
	toB.Partition()
	t.Cleanup(toA.Heal)
	t.Cleanup(toB.Heal)
	waitFor(t, 30*time.Second, "replica B to end the partitioned stream", func(ct assert.TestingT) {
		assert.Zero(ct, replicaB.Connected(framework.FleetNamespace, profile), "replica B's agent streams of %s", profile)
	})

	// A acknowledges the revoke as pending, and dies.
	rctx, cancel := context.WithTimeout(c.Context(ctx), 2*mintTimeout)
	defer cancel()
	answer, err := grantsA.Revoke(rctx, &pb.RevokeGrantsRequest{Selector: selector, Reason: "faults: the token leaked"})
	require.NoError(t, err)
	require.Empty(t, answer.GetRevoked())
	require.Len(t, answer.GetPending(), 1)
	require.Equal(t, id, answer.GetPending()[0].GetCredentialId())
	require.NoError(t, replicaA.Signal(syscall.SIGKILL))
	require.Error(t, replicaA.Wait())

	// The agent comes back, to replica B only.
	toB.Heal()
	toA.Heal()
	back := time.Now()
	waitFor(t, 30*time.Second, "the spoke to refuse the revoked token", func(ct assert.TestingT) {
		review, err := spoke2.ReviewToken(ctx, resp.GetToken(), nil)
		if assert.NoError(ct, err, "TokenReview on spoke-2") {
			assert.False(ct, review.Authenticated, "the revoked token is authenticated as %s", review.User.Username)
		}
	})
	died := time.Since(back)
	t.Logf("acknowledged revoke, replica A killed: the spoke refused the token %s after the agent's return, through replica B",
		died.Round(10*time.Millisecond))
	require.Less(t, died, 20*time.Second)
}
