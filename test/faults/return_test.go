package faults

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/credbroker/credbroker/internal/testing/faultproxy"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// A cluster's only agent stream breaks (a TCP reset between the agent and
// the broker) and the agent, the shipped binary, comes back within its
// first backoff: the exchanges that need it meanwhile wait for it
// (--agent-return-wait) and are minted. Before, each was refused
// Unavailable at once ("no agent is connected").
func TestExchangesWaitForAnAgentThatReturns(t *testing.T) {
	ctx := t.Context()
	proxy, err := faultproxy.New(deployment.Broker.AgentAddr())
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })

	name := unique("return")
	_, err = env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, deployment.ProfileAccess(spoke1, framework.FleetNamespace, name))
	require.NoError(t, err)
	t.Cleanup(func() { deleteClusterProfile(t, name) })
	agent, err := deployment.StartAgentProcess(ctx, spoke1, framework.AgentProcessOptions{
		Bin: agentBin, ClusterProfile: name, BrokerAddresses: []string{proxy.Addr()}})
	require.NoError(t, err)
	t.Cleanup(agent.Stop)
	connected := func() int { return deployment.Broker.Connected(framework.FleetNamespace, name) }
	waitFor(t, time.Minute, "the agent's stream", func() bool { return connected() == 1 })

	client, conn, err := deployment.ExchangeClient(deployment.Broker.ExchangeAddr())
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	// One consumer per round, and one to begin with: a consumer's first
	// exchange is a mint, which only the agent can answer.
	var consumers []framework.Consumer
	var usernames []string
	for range 4 {
		c, err := env.NewConsumer(ctx, unique("return-hub"), "consumer", "credbroker", name)
		require.NoError(t, err)
		consumers, usernames = append(consumers, c), append(usernames, c.Username())
	}
	spokeNS := unique("return-spoke")
	require.NoError(t, spoke1.EnsureNamespace(ctx, spokeNS))
	require.NoError(t, deployment.OptIn(ctx, spoke1, spokeNS, "target", usernames...))
	_, err = exchangeTarget(t, client, consumers[0], name, spokeNS) // once the agent knows the opt-in
	require.NoError(t, err)

	for round, c := range consumers[1:] {
		proxy.Down()
		waitFor(t, 10*time.Second, "the broker to see the stream end", func() bool { return connected() == 0 })
		proxy.Heal()
		began := time.Now()
		cctx, cancel := context.WithTimeout(c.Context(ctx), mintTimeout)
		_, err := client.Exchange(cctx, &pb.ExchangeRequest{
			Cluster:        &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: name},
			ServiceAccount: &pb.ObjectReference{Namespace: spokeNS, Name: "target"},
		})
		cancel()
		require.NoError(t, err, "round %d", round)
		t.Logf("round %d: minted %s after the broker saw the stream end", round, time.Since(began).Round(time.Millisecond))
	}
}
