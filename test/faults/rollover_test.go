package faults

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// rolloverConsumers share one address, as the pods of one node behind its
// SNAT, or of one namespace behind an egress gateway, do.
const rolloverConsumers = 64

// Consumers that keep calling never meet a limiter when their cached
// decisions expire. 64 consumers behind one address call a broker process
// with its default flags for CREDBROKER_ROLLOVER_DURATION (60s): their
// TokenReviews and SubjectAccessReviews were made together, so they expire
// together every --authn-ttl and --authz-allow-ttl (10s). Before: each
// round of expiry sent 64 new reviews from one address at once, and the
// per-address review limit (10/s, burst 20) refused the calls of the
// consumers past its burst with ResourceExhausted. The hub's review count stays near consumers × duration
// ÷ TTL: the decisions are refreshed, not kept forever.
func TestDecisionsRollOverWithoutRefusals(t *testing.T) {
	duration := durationFromEnv(t, "CREDBROKER_ROLLOVER_DURATION", time.Minute)
	addrs := make([]string, 3)
	for i := range addrs {
		var err error
		addrs[i], err = framework.FreeAddr()
		require.NoError(t, err)
	}
	brokerOpts := framework.BrokerProcessOptions{Bin: brokerBin, ExchangeAddress: addrs[0], AgentAddress: addrs[1], MetricsAddress: addrs[2],
		Args: []string{"--audit-log-path=" + filepath.Join(t.TempDir(), "audit.log")}}
	broker, err := deployment.StartBrokerProcess(brokerOpts)
	require.NoError(t, err)
	t.Cleanup(broker.Stop)
	agent, err := deployment.StartAgentProcess(t.Context(), spoke1, framework.AgentProcessOptions{Bin: agentBin, BrokerAddresses: []string{brokerOpts.AgentAddress}})
	require.NoError(t, err)
	t.Cleanup(agent.Stop)
	metric := func(name string, labels ...string) float64 {
		m, err := framework.ScrapeMetrics(t.Context(), brokerOpts.MetricsAddress)
		if err != nil {
			return -1
		}
		return m.Sum(name, labels...)
	}
	waitFor(t, time.Minute, "the agent process to connect", func(c assert.TestingT) {
		assert.Equal(c, 1.0, metric("credbroker_connected_clusters"), "the broker process's credbroker_connected_clusters (-1: no scrape)")
	}, broker, agent)

	// The consumers, each its own hub ServiceAccount, in four namespaces
	// (whose review limits are of their own too), may all get tokens for
	// one spoke ServiceAccount.
	ctx := t.Context()
	spokeNS := unique("rollover-spoke")
	var groups []string
	consumers := make([]framework.Consumer, rolloverConsumers)
	for i := range consumers {
		if i%(rolloverConsumers/4) == 0 {
			groups = append(groups, "group:system:serviceaccounts:"+unique("rollover"))
		}
		hubNS := strings.TrimPrefix(groups[len(groups)-1], "group:system:serviceaccounts:")
		consumers[i], err = env.NewConsumer(ctx, hubNS, fmt.Sprintf("c-%d", i), "credbroker", spoke1.Name)
		require.NoError(t, err)
	}
	require.NoError(t, spoke1.EnsureNamespace(ctx, spokeNS))
	require.NoError(t, deployment.OptIn(ctx, spoke1, spokeNS, "target", groups...))
	// dial connects from a loopback address of its own, 127.0.0.1 for
	// the address all the consumers share.
	dial := func(i int) pb.TokenExchangeClient {
		local := &net.TCPAddr{IP: net.IPv4(127, 0, byte(i/250), byte(1+i%250))}
		client, conn, err := deployment.ExchangeClient(brokerOpts.ExchangeAddress, grpc.WithContextDialer(
			func(ctx context.Context, addr string) (net.Conn, error) {
				return (&net.Dialer{LocalAddr: local}).DialContext(ctx, "tcp", addr)
			}))
		require.NoError(t, err)
		t.Cleanup(func() { _ = conn.Close() })
		return client
	}
	exchange := func(client pb.TokenExchangeClient, c framework.Consumer) codes.Code {
		ctx, cancel := context.WithTimeout(c.Context(ctx), 30*time.Second)
		defer cancel()
		_, err := client.Exchange(ctx, &pb.ExchangeRequest{
			Cluster:        &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: spoke1.Name},
			ServiceAccount: &pb.ObjectReference{Namespace: spokeNS, Name: "target"},
		})
		return status.Code(err)
	}

	// Their decisions are made together: their first calls come from
	// addresses of their own at once, as from the nodes they ran on before
	// they were moved behind one, and refresh together from then on.
	var wg sync.WaitGroup
	for i, c := range consumers {
		wg.Go(func() {
			if code := exchange(dial(i+1), c); code != codes.OK {
				t.Errorf("the first exchange of %s: %s", c.Name, code)
			}
		})
	}
	wg.Wait()
	require.False(t, t.Failed())
	shared := dial(0)

	reviewsBefore := metric("credbroker_hub_review_duration_seconds", `kind="TokenReview"`)
	accessBefore := metric("credbroker_hub_review_duration_seconds", `kind="SubjectAccessReview"`)
	var (
		mu     sync.Mutex
		byCode = map[codes.Code]int{}
	)
	end := time.Now().Add(duration)
	for _, c := range consumers {
		wg.Go(func() {
			for time.Now().Before(end) {
				code := exchange(shared, c)
				mu.Lock()
				byCode[code]++
				mu.Unlock()
				time.Sleep(100 * time.Millisecond)
			}
		})
	}
	wg.Wait()
	reviews := metric("credbroker_hub_review_duration_seconds", `kind="TokenReview"`) - reviewsBefore
	access := metric("credbroker_hub_review_duration_seconds", `kind="SubjectAccessReview"`) - accessBefore
	expected := float64(rolloverConsumers) * duration.Seconds() / 10 // the default TTLs
	t.Logf("%d consumers behind one address for %s: calls by code %v; %.0f TokenReviews and %.0f SubjectAccessReviews (consumers × duration ÷ TTL = %.0f)",
		rolloverConsumers, duration, byCode, reviews, access, expected)
	assert.Len(t, byCode, 1, "every call succeeds")
	assert.Positive(t, byCode[codes.OK], "every call succeeds")
	for kind, n := range map[string]float64{"TokenReviews": reviews, "SubjectAccessReviews": access} {
		assert.GreaterOrEqual(t, n, expected/2, "%s: the decisions are refreshed", kind)
		assert.LessOrEqual(t, n, 2*expected, "%s: each decision is refreshed about once per TTL", kind)
	}
}
