package faults

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// Two agents of one spoke, as the DaemonSet runs them, each with its grant
// pool (the default --grant-pool-size): the tokens that either answers from
// a pooled grant stay valid once their claims land. Before, each agent took
// the other's claim for someone else's change and deleted the grant, which
// revoked the token it had just answered.
func TestPooledTokensOfTwoAgentsStayValid(t *testing.T) {
	ctx := t.Context()
	name := unique("pool")
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, deployment.ProfileAccess(spoke1, framework.FleetNamespace, name))
	require.NoError(t, err)
	t.Cleanup(func() { deleteClusterProfile(t, name) })
	for range 2 {
		agent, err := deployment.StartAgentProcess(ctx, spoke1, framework.AgentProcessOptions{
			Bin: agentBin, ClusterProfile: name, BrokerAddresses: []string{deployment.Broker.AgentAddr()}})
		require.NoError(t, err)
		t.Cleanup(agent.Stop)
		t.Cleanup(func() {
			if t.Failed() {
				t.Logf("agent:\n%s", agent.Output())
			}
		})
	}
	client, conn, err := deployment.ExchangeClient(deployment.Broker.ExchangeAddr())
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })

	// Consumers of one spoke ServiceAccount, each a mint of its own: the
	// first of each agent creates its grant, the rest take pooled ones.
	const consumers = 8
	spokeNS := unique("pool-spoke")
	var callers []framework.Consumer
	var usernames []string
	for range consumers {
		c, err := env.NewConsumer(ctx, unique("pool-hub"), "consumer", "credbroker", name)
		require.NoError(t, err)
		callers, usernames = append(callers, c), append(usernames, c.Username())
	}
	require.NoError(t, spoke1.EnsureNamespace(ctx, spokeNS))
	require.NoError(t, deployment.OptIn(ctx, spoke1, spokeNS, "target", usernames...))
	var tokens []string
	for _, c := range callers {
		var resp *pb.ExchangeResponse
		waitFor(t, time.Minute, "a token", func() bool {
			cctx, cancel := context.WithTimeout(c.Context(ctx), 10*time.Second)
			defer cancel()
			resp, err = client.Exchange(cctx, &pb.ExchangeRequest{
				Cluster:        &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: name},
				ServiceAccount: &pb.ObjectReference{Namespace: spokeNS, Name: "target"},
			})
			return err == nil
		})
		tokens = append(tokens, resp.GetToken())
		time.Sleep(200 * time.Millisecond) // lets the pools refill between mints; not synchronization
	}

	// Every claim lands and stays: no agent deletes another's.
	claimed := func() int {
		grants, err := spoke1.ClaimedGrants(ctx, spokeNS)
		require.NoError(t, err)
		return len(grants)
	}
	waitFor(t, 30*time.Second, "every token's claim", func() bool { return claimed() == consumers })
	time.Sleep(2 * time.Second) // an agent that took a claim for a change would have deleted it by now; not synchronization
	assert.Equal(t, consumers, claimed(), "claimed grants were deleted")
	for i, tok := range tokens {
		review, err := spoke1.ReviewToken(ctx, tok, nil)
		require.NoError(t, err)
		assert.True(t, review.Authenticated, "the token of consumer %d was revoked: %s", i, review.Error)
	}
}
