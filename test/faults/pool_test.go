package faults

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// twoAgents creates a ClusterProfile of spoke1 that two shipped agents
// serve, as the DaemonSet runs them, each with its grant pool (the default
// --grant-pool-size) and a stream to each broker address (the deployment's
// broker when none is given), and n consumers of it that spoke1's
// ServiceAccount target in a new namespace allows. It returns the
// profile's name, the namespace, the agents, the consumers and an
// exchange client of the deployment's broker.
func twoAgents(t *testing.T, prefix string, n int, brokers ...string) (name, spokeNS string, agents []*framework.Process, consumers []framework.Consumer, client pb.TokenExchangeClient) {
	t.Helper()
	ctx := t.Context()
	name = unique(prefix)
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, deployment.ProfileAccess(spoke1, framework.FleetNamespace, name))
	require.NoError(t, err)
	t.Cleanup(func() { deleteClusterProfile(t, name) })
	if len(brokers) == 0 {
		brokers = []string{deployment.Broker.AgentAddr()}
	}
	for range 2 {
		agent, err := deployment.StartAgentProcess(ctx, spoke1, framework.AgentProcessOptions{
			Bin: agentBin, ClusterProfile: name, BrokerAddresses: brokers})
		require.NoError(t, err)
		agents = append(agents, agent)
		t.Cleanup(agent.Stop)
		t.Cleanup(func() {
			if t.Failed() {
				t.Logf("agent:\n%s", agent.Output())
			}
		})
	}
	waitFor(t, time.Minute, "both agents' streams", func(c assert.TestingT) {
		assert.Equal(c, 2, deployment.Broker.Connected(framework.FleetNamespace, name), "agent streams of %s on the broker", name)
	}, agents...)
	client, conn, err := deployment.ExchangeClient(deployment.Broker.ExchangeAddr())
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })

	spokeNS = unique(prefix + "-spoke")
	var usernames []string
	for range n {
		c, err := env.NewConsumer(ctx, unique(prefix+"-hub"), "consumer", "credbroker", name)
		require.NoError(t, err)
		consumers, usernames = append(consumers, c), append(usernames, c.Username())
	}
	require.NoError(t, spoke1.EnsureNamespace(ctx, spokeNS))
	require.NoError(t, deployment.OptIn(ctx, spoke1, spokeNS, "target", usernames...))
	return name, spokeNS, agents, consumers, client
}

// exchangeTarget exchanges c's hub token for a token of spokeNS/target
// through the ClusterProfile name, trying again for up to a minute while
// the agents learn the opt-in; a refusal for a Secret quota is final.
func exchangeTarget(t *testing.T, client pb.TokenExchangeClient, c framework.Consumer, name, spokeNS string) (*pb.ExchangeResponse, error) {
	t.Helper()
	var (
		resp *pb.ExchangeResponse
		err  error
	)
	exchange := func() bool {
		ctx, cancel := context.WithTimeout(c.Context(t.Context()), 10*time.Second)
		defer cancel()
		resp, err = client.Exchange(ctx, &pb.ExchangeRequest{
			Cluster:        &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: name},
			ServiceAccount: &pb.ObjectReference{Namespace: spokeNS, Name: "target"},
		})
		return err == nil
	}
	deadline := time.Now().Add(time.Minute)
	for !exchange() && time.Now().Before(deadline) && !strings.Contains(err.Error(), "ResourceQuota") {
		time.Sleep(100 * time.Millisecond)
	}
	return resp, err
}

// The tokens that either agent answers from a pooled grant stay valid
// once their claims land. Before, each agent took the other's claim for
// someone else's change and deleted the grant, which revoked the token it
// had just answered.
func TestPooledTokensOfTwoAgentsStayValid(t *testing.T) {
	ctx := t.Context()
	// Consumers of one spoke ServiceAccount, each a mint of its own: the
	// first creates its grant, the rest take pooled ones. Every agent
	// watches every claim.
	const consumers = 8
	name, spokeNS, _, callers, client := twoAgents(t, "pool", consumers)
	var tokens []string
	for _, c := range callers {
		resp, err := exchangeTarget(t, client, c, name, spokeNS)
		require.NoError(t, err)
		tokens = append(tokens, resp.GetToken())
		time.Sleep(200 * time.Millisecond) // lets the pool refill between mints; not synchronization
	}

	// Every claim lands and stays: no agent deletes another's.
	claimed := func() int {
		grants, err := spoke1.ClaimedGrants(ctx, spokeNS)
		require.NoError(t, err)
		return len(grants)
	}
	waitFor(t, 30*time.Second, "every token's claim", func(c assert.TestingT) { assert.Equal(c, consumers, claimed(), "claimed grants in %s", spokeNS) })
	time.Sleep(2 * time.Second) // an agent that took a claim for a change would have deleted it by now; not synchronization
	assert.Equal(t, consumers, claimed(), "claimed grants were deleted")
	for i, tok := range tokens {
		review, err := spoke1.ReviewToken(ctx, tok, nil)
		require.NoError(t, err)
		assert.True(t, review.Authenticated, "the token of consumer %d was revoked: %s", i, review.Error)
	}
}

// Attack (docs/security.md 32.13): a namespace's Secrets are under a
// ResourceQuota that its consumers' two live tokens fit in, with one
// Secret to spare. Each agent keeps pooled grants of its own in the
// namespaces it mints in, and mints went round robin over the agents: the
// first agent's grant and its two pooled grants filled the quota, and the
// second consumer's mint, on the other agent, was refused.
// Defence: the broker sends a namespace's mints to one agent, which takes
// its own pooled grant.
func TestPooledGrantsOfOneAgentDoNotRefuseAnothersMint(t *testing.T) {
	ctx := t.Context()
	name, spokeNS, _, callers, client := twoAgents(t, "quota", 2)
	secrets := func() int {
		list, err := spoke1.Client.CoreV1().Secrets(spokeNS).List(ctx, metav1.ListOptions{})
		require.NoError(t, err)
		return len(list.Items)
	}
	require.Zero(t, secrets())
	// No quota controller runs beside the test API server: the status that
	// it would write is written here, and quota admission counts on from it.
	three := corev1.ResourceList{corev1.ResourceSecrets: resource.MustParse("3")}
	quota, err := spoke1.Client.CoreV1().ResourceQuotas(spokeNS).Create(ctx, &corev1.ResourceQuota{
		ObjectMeta: metav1.ObjectMeta{Name: "secrets"},
		Spec:       corev1.ResourceQuotaSpec{Hard: three},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	quota.Status = corev1.ResourceQuotaStatus{Hard: three, Used: corev1.ResourceList{corev1.ResourceSecrets: resource.MustParse("0")}}
	_, err = spoke1.Client.CoreV1().ResourceQuotas(spokeNS).UpdateStatus(ctx, quota, metav1.UpdateOptions{})
	require.NoError(t, err)

	var tokens []string
	resp, err := exchangeTarget(t, client, callers[0], name, spokeNS)
	require.NoError(t, err)
	tokens = append(tokens, resp.GetToken())
	waitFor(t, 30*time.Second, "the first token's grant and its agent's two pooled grants", func(c assert.TestingT) {
		assert.Equal(c, 3, secrets(), "Secrets in %s", spokeNS)
	})

	resp, err = exchangeTarget(t, client, callers[1], name, spokeNS)
	require.NoError(t, err, "the second consumer's mint was refused for the other agent's pooled grants")
	tokens = append(tokens, resp.GetToken())
	for i, tok := range tokens {
		review, err := spoke1.ReviewToken(ctx, tok, nil)
		require.NoError(t, err)
		assert.True(t, review.Authenticated, "the token of consumer %d does not authenticate: %s", i, review.Error)
	}
}

// Attack (docs/security.md 32.13, across replicas): agents reach every
// broker replica, and each replica picks a namespace's agent on its own,
// by the agents' instance names. An agent named each of its broker
// streams anew, so the replicas ranked it apart: a namespace's mints
// through two replicas went to two agents, each keeping pooled grants in
// the namespace (and for each namespace, both replicas picked the same
// agent only half the time).
// Defence: an agent has one instance name for all its broker streams.
func TestReplicasSendANamespacesMintsToOneAgent(t *testing.T) {
	ctx := t.Context()
	opts := replicaOptions(t)
	replica, err := deployment.StartBrokerProcess(opts)
	require.NoError(t, err)
	t.Cleanup(replica.Stop)
	name, firstNS, agents, consumers, client := twoAgents(t, "replicas", 1, deployment.Broker.AgentAddr(), opts.AgentAddress)
	other, conn, err := deployment.ExchangeClient(opts.ExchangeAddress)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })

	// One consumer, one namespace after another, through either replica:
	// each replica's token cache misses, so each replica mints.
	const namespaces = 6
	c := consumers[0]
	spokeNSs := []string{firstNS}
	for len(spokeNSs) < namespaces {
		ns := unique("replicas-spoke")
		require.NoError(t, spoke1.EnsureNamespace(ctx, ns))
		require.NoError(t, deployment.OptIn(ctx, spoke1, ns, "target", c.Username()))
		spokeNSs = append(spokeNSs, ns)
	}
	for _, ns := range spokeNSs {
		for _, broker := range []pb.TokenExchangeClient{client, other} {
			_, err := exchangeTarget(t, broker, c, name, ns)
			require.NoError(t, err)
		}
	}
	for _, ns := range spokeNSs {
		var minters int
		for _, a := range agents {
			if mintedFor(a.Output(), ns+"/target") > 0 {
				minters++
			}
		}
		assert.Equal(t, 1, minters, "the mints of namespace %s through two replicas went to %d agents", ns, minters)
	}
}

// mintedFor counts the "minted spoke token" lines of an agent's log for
// the ServiceAccount sa (namespace/name).
func mintedFor(log, sa string) int {
	n := 0
	for line := range strings.Lines(log) {
		if strings.Contains(line, `"minted spoke token"`) && strings.Contains(line, `serviceAccount="`+sa+`"`) {
			n++
		}
	}
	return n
}
