package e2e

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/credbroker/credbroker/internal/testing/testpki"
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
	name, ttl := uniqueName(t, "expiring"), 30*time.Second
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, deployment.ProfileAccess(spoke, framework.FleetNamespace, name))
	require.NoError(t, err)
	c := newConsumer(t, "credbroker", name)
	optInAudiences(t, spoke, "expiring-sa", []string{"before-expiry", "after-expiry", "after-renewal"}, c.username())

	issued := time.Now()
	stop, err := deployment.StartAgentWith(ctx, spoke, framework.AgentOptions{ID: framework.AgentID(name), SVIDTTL: ttl})
	require.NoError(t, err)
	defer stop()
	ref := &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: name}
	for i, b := range deployment.Brokers {
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			assert.Equal(ct, 1, b.Connected(framework.FleetNamespace, name), "agent streams of %s", name)
		}, 10*time.Second, 20*time.Millisecond)
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

	// The SVID is renewed: the agent reconnects with it, over a new
	// connection (the old one's handshake presented the expired SVID).
	err = deployment.WriteAgentSVID(spoke, framework.AgentID(name), deployment.CA, time.Hour)
	require.NoError(t, err)
	for i, b := range deployment.Brokers {
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			assert.Equal(ct, 1, b.Connected(framework.FleetNamespace, name), "agent streams of %s", name)
		}, 30*time.Second, 50*time.Millisecond,
			"replica %d never readmits the agent with its renewed SVID", i)
		_, err := exchangeVia(t, exchangeClientAt(t, b.ExchangeAddr()), c, &pb.ExchangeRequest{Cluster: ref, Audiences: []string{"after-renewal"}})
		require.NoError(t, err, "replica %d", i)
	}
}

// Trust boundary 5.3: when the trust bundle drops a CA, the brokers close
// the streams of agents whose SVID it issued, without waiting for those
// SVIDs to expire.
func TestBundleWithoutTheCAClosesItsAgentsStreams(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[1]
	name := uniqueName(t, "rotated")
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, deployment.ProfileAccess(spoke, framework.FleetNamespace, name))
	require.NoError(t, err)

	// The trust domain gains a second CA, and the agent of fleet/rotated an
	// SVID from it.
	second, err := testpki.NewCA(framework.TrustDomain)
	require.NoError(t, err)
	writeBundle := func(pems ...[]byte) {
		t.Helper()
		require.NoError(t, testpki.WriteFileAtomic(deployment.CAFile, bytes.Join(pems, nil), 0o600))
	}
	writeBundle(deployment.CA.BundlePEM(), second.BundlePEM())
	t.Cleanup(func() { writeBundle(deployment.CA.BundlePEM()) })
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		// Refused by the mapping, no longer by the handshake.
		err := connectAs(t, second, framework.AgentID("no-such-profile"))
		assert.Equal(ct, codes.PermissionDenied, status.Code(err), "an agent of the second CA: %v", err)
	}, 30*time.Second, 200*time.Millisecond, "the brokers never trust the second CA")
	stop, err := deployment.StartAgentWith(ctx, spoke, framework.AgentOptions{ID: framework.AgentID(name), CA: second})
	require.NoError(t, err)
	defer stop()
	for i, b := range deployment.Brokers {
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			assert.Equal(ct, 1, b.Connected(framework.FleetNamespace, name), "agent streams of %s", name)
		}, 30*time.Second, 50*time.Millisecond,
			"replica %d never admits the agent", i)
	}

	// The second CA leaves the bundle; its agent's SVID is still valid.
	writeBundle(deployment.CA.BundlePEM())
	for i, b := range deployment.Brokers {
		assert.EventuallyWithT(t, func(ct *assert.CollectT) {
			assert.Zero(ct, b.Connected(framework.FleetNamespace, name), "agent streams of %s", name)
		}, 30*time.Second, 50*time.Millisecond,
			"replica %d keeps the stream of an agent whose CA left the bundle", i)
	}
	// The other agents, whose CA stayed, keep serving.
	for i, b := range deployment.Brokers {
		assert.Equal(t, 1, b.Connected(framework.FleetNamespace, env.Spokes[0].Name), "replica %d", i)
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

	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		log := lines.String()
		assert.GreaterOrEqual(ct, strings.Count(log, "broker admitted the agent for another ClusterProfile"), 2*len(deployment.Brokers),
			"the agent's refusals of a broker; its last lines:\n%s", framework.LastLines(log, 20))
	}, 20*time.Second, 50*time.Millisecond, "the agent keeps retrying every broker")
	assert.Contains(t, lines.String(), `"admittedFor"="fleet/`+spoke.Name+`" "expected"="fleet/elsewhere"`)
	assert.NotContains(t, lines.String(), "connected to broker")
}
