package faults

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/credbroker/credbroker/internal/testing/faultproxy"
	"github.com/credbroker/credbroker/pkg/spoke"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// proxiedAgent creates a ClusterProfile of spoke1 whose only agent, the
// shipped binary, reaches the broker through a fault proxy, and waits for
// its stream. It returns the profile's name, the proxy, the count of the
// profile's streams and an exchange client of the broker.
func proxiedAgent(t *testing.T, prefix string) (name string, proxy *faultproxy.Proxy, connected func() int, client pb.TokenExchangeClient) {
	t.Helper()
	ctx := t.Context()
	proxy, err := faultproxy.New(deployment.Broker.AgentAddr())
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	name = unique(prefix)
	_, err = env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, deployment.ProfileAccess(spoke1, framework.FleetNamespace, name))
	require.NoError(t, err)
	t.Cleanup(func() { deleteClusterProfile(t, name) })
	agent, err := deployment.StartAgentProcess(ctx, spoke1, framework.AgentProcessOptions{
		Bin: agentBin, ClusterProfile: name, BrokerAddresses: []string{proxy.Addr()}})
	require.NoError(t, err)
	t.Cleanup(agent.Stop)
	connected = func() int { return deployment.Broker.Connected(framework.FleetNamespace, name) }
	waitFor(t, time.Minute, "the agent's stream", func(c assert.TestingT) { assert.Equal(c, 1, connected(), "agent streams of %s on the broker", name) }, agent)
	client, conn, err := deployment.ExchangeClient(deployment.Broker.ExchangeAddr())
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return name, proxy, connected, client
}

// A cluster's only agent stream breaks (a TCP reset between the agent and
// the broker) and the agent, the shipped binary, comes back within its
// first backoff: the exchanges that need it meanwhile wait for it
// (--agent-return-wait) and are minted. Before, each was refused
// Unavailable at once ("no agent is connected").
func TestExchangesWaitForAnAgentThatReturns(t *testing.T) {
	ctx := t.Context()
	name, proxy, connected, client := proxiedAgent(t, "return")
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
	_, err := exchangeTarget(t, client, consumers[0], name, spokeNS) // once the agent knows the opt-in
	require.NoError(t, err)

	for round, c := range consumers[1:] {
		proxy.Down()
		waitFor(t, 10*time.Second, "the broker to see the stream end", func(c assert.TestingT) {
			assert.Zero(c, connected(), "agent streams of %s on the broker", name)
		})
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

// A grant is deleted (its holder, or a spoke admin, revokes the token by
// hand) while the agent's only stream to the broker is down. The agent
// tells removals once, on the streams open when it sees them, and the
// broker never drops a grant that a hello leaves out: the broker went on
// answering the consumer with the dead token from its cache until the
// cache entry's halfway. The agent, the shipped binary, now tells the
// removals it remembers after every hello, and the next exchange mints a
// token that works.
func TestRemovalWhileTheStreamWasDownIsLearnt(t *testing.T) {
	ctx := t.Context()
	name, proxy, connected, client := proxiedAgent(t, "gap")
	c, err := env.NewConsumer(ctx, unique("gap-hub"), "consumer", "credbroker", name)
	require.NoError(t, err)
	spokeNS := unique("gap-spoke")
	require.NoError(t, spoke1.EnsureNamespace(ctx, spokeNS))
	require.NoError(t, deployment.OptIn(ctx, spoke1, spokeNS, "target", c.Username()))
	dead, err := exchangeTarget(t, client, c, name, spokeNS)
	require.NoError(t, err)
	// The claim of a pooled grant lands after the answer: the grant is
	// deleted once it has, so that its removal is the grant's own.
	jti, _ := strings.CutPrefix(dead.GetCredentialId(), "JTI=")
	waitFor(t, 10*time.Second, "the grant's claim", func(c assert.TestingT) {
		list, err := spoke1.Client.CoreV1().Secrets(spokeNS).List(ctx, metav1.ListOptions{LabelSelector: spoke.GrantJTILabel + "=" + jti})
		require.NoError(t, err)
		assert.Len(c, list.Items, 1, "grants of JTI=%s in %s", jti, spokeNS)
	})

	proxy.Down()
	waitFor(t, 10*time.Second, "the broker to see the stream end", func(c assert.TestingT) {
		assert.Zero(c, connected(), "agent streams of %s on the broker", name)
	})
	grant, err := framework.BoundSecret(dead.GetToken())
	require.NoError(t, err)
	require.NoError(t, spoke1.Client.CoreV1().Secrets(spokeNS).Delete(ctx, grant, metav1.DeleteOptions{}))
	// The agent's informer sees the deletion within milliseconds; the
	// pause makes it see it while no stream is open. Were it late, the
	// next stream would carry it anyway, and the test would prove less,
	// not fail.
	time.Sleep(2 * time.Second)
	proxy.Heal()
	waitFor(t, time.Minute, "the agent's stream back", func(c assert.TestingT) {
		assert.Equal(c, 1, connected(), "agent streams of %s on the broker", name)
	})

	var fresh *pb.ExchangeResponse
	took := waitFor(t, 10*time.Second, "an exchange that does not answer with the token whose grant is gone", func(ct assert.TestingT) {
		fresh, err = exchangeTarget(t, client, c, name, spokeNS)
		require.NoError(t, err)
		assert.NotEqual(ct, dead.GetCredentialId(), fresh.GetCredentialId(), "the credential of the exchange's answer")
	})
	review, err := spoke1.ReviewToken(ctx, fresh.GetToken(), nil)
	require.NoError(t, err)
	require.True(t, review.Authenticated, "the new token does not authenticate: %s", review.Error)
	t.Logf("stream gap: a new token %s after the agent's stream came back", took.Round(10*time.Millisecond))
}
