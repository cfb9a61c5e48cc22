package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// Trust boundary 5: an agent's stream does not outlive its identity. The
// agent of fleet/expiring holds an SVID that expires in 30 s and that
// nothing renews, as if it were stolen. Before the fix its streams, checked
// only at the handshake, kept minting for as long as TCP lived.
func TestAgentStreamEndsWithItsSVID(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[1]
	const name, ttl = "expiring", 30 * time.Second
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, deployment.ClusterProfileAccess(spoke))
	require.NoError(t, err)
	c := newConsumer(t, "credbroker", name)
	optInAudiences(t, spoke, "expiring-sa", []string{"before-expiry", "after-expiry"}, c.username())

	issued := time.Now()
	stop, err := deployment.StartAgentWith(ctx, spoke, framework.AgentOptions{ID: framework.AgentID(name), SVIDTTL: ttl})
	require.NoError(t, err)
	defer stop()
	ref := &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: name}
	for i, b := range deployment.Brokers {
		require.Eventually(t, func() bool { return b.Connected(framework.FleetNamespace, name) == 1 }, 10*time.Second, 20*time.Millisecond)
		_, err := exchangeVia(t, exchangeClientAt(t, b.ExchangeAddr()), c, &pb.ExchangeRequest{Cluster: ref, Audiences: []string{"before-expiry"}})
		require.NoError(t, err, "replica %d: the agent serves while its SVID is valid", i)
	}

	time.Sleep(time.Until(issued.Add(ttl + 10*time.Second)))
	for i, b := range deployment.Brokers {
		assert.Zero(t, b.Connected(framework.FleetNamespace, name), "replica %d keeps a stream of an expired SVID", i)
		// A new audience misses the token cache, so the broker must mint.
		_, err := exchangeVia(t, exchangeClientAt(t, b.ExchangeAddr()), c, &pb.ExchangeRequest{Cluster: ref, Audiences: []string{"after-expiry"}})
		assert.Equal(t, codes.Unavailable, status.Code(err), "replica %d: %v", i, err)
	}
}

// An agent told which ClusterProfile it serves (--cluster) leaves a broker
// that admits it for another one, and keeps trying with backoff.
func TestAgentRefusesAnotherCluster(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	lines := &syncBuffer{}
	log := funcr.New(func(prefix, args string) { lines.WriteString(prefix + " " + args + "\n") }, funcr.Options{})
	stop, err := deployment.StartAgentWith(ctx, spoke, framework.AgentOptions{
		ID: framework.AgentID(spoke.Name), Cluster: framework.FleetNamespace + "/elsewhere", NoWait: true, Log: &log,
	})
	require.NoError(t, err)
	defer stop()

	require.Eventually(t, func() bool {
		return strings.Count(lines.String(), "broker admitted the agent for another ClusterProfile") >= 2*len(deployment.Brokers)
	}, 20*time.Second, 50*time.Millisecond, "the agent keeps retrying every broker")
	assert.Contains(t, lines.String(), `"admittedFor"="fleet/`+spoke.Name+`" "expected"="fleet/elsewhere"`)
	assert.NotContains(t, lines.String(), "connected to broker")
}
