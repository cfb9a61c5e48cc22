//go:build soak

package faults

import (
	"context"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// coldAudiences is how many audiences the cold loop's ServiceAccount
// allows: pairs of them make the tokens it asks for, each new.
const coldAudiences = 200

// TestSoak (make soak; not in CI) runs the shipped broker and spoke-agent
// binaries under a mixed load for SOAK_DURATION (default 10m): cached
// exchanges, cold ones (a new audience pair each time, so a mint each), and
// refused ones (a consumer without hub RBAC). A third of the way through,
// the broker restarts (SIGTERM, then started again on the same ports); two
// thirds of the way, the agent does. It reports the broker's and the
// agent's RSS and goroutines at the start and the end, and the calls by
// kind and code. The only failures allowed are Unavailable while a process
// restarts; at the end the fleet serves, no mint is pending, and the
// goroutines are what they were at the start, within the churn's slack.
func TestSoak(t *testing.T) {
	ctx := t.Context()
	total := durationFromEnv(t, "SOAK_DURATION", 10*time.Minute)
	f := startProcFleet(t)
	c := newCaller(t, 1, spoke1)
	c.client = f.client
	stranger, err := env.NewConsumer(ctx, c.Namespace, "stranger", "credbroker")
	require.NoError(t, err)
	var auds []string
	for i := range coldAudiences {
		auds = append(auds, fmt.Sprintf("cold-%d", i))
	}
	sa, err := spoke1.CreateServiceAccount(ctx, c.targetNS, "cold", map[string]string{
		"credbroker.io/allowed-subjects":  c.Username(),
		"credbroker.io/allowed-audiences": strings.Join(auds, ","),
	})
	require.NoError(t, err)
	require.NoError(t, deployment.WaitForServiceAccount(ctx, spoke1, sa))
	waitFor(t, time.Minute, "the fleet to serve", func(ct assert.TestingT) { c.assertServes(ct, spoke1, 0, mintTimeout) }, f.broker, f.agent)

	exchange := func(consumer framework.Consumer, sa string, audiences func(i int) []string) func(ctx context.Context, i int) error {
		return func(ctx context.Context, i int) error {
			req := &pb.ExchangeRequest{
				Cluster:        &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: spoke1.Name},
				ServiceAccount: &pb.ObjectReference{Namespace: c.targetNS, Name: sa},
			}
			if audiences != nil {
				req.Audiences = audiences(i)
			}
			_, err := f.client.Exchange(consumer.Context(ctx), req)
			return err
		}
	}
	cold := exchange(c.Consumer, "cold", func(i int) []string {
		a := i % coldAudiences
		return []string{auds[a], auds[(a+1+i/coldAudiences)%coldAudiences]}
	})
	load := startLoad(
		loop{kind: "cached", do: exchange(c.Consumer, "target-0", nil)},
		loop{kind: "cold", do: func(ctx context.Context, i int) error {
			time.Sleep(100 * time.Millisecond) // about ten mints a second: the spoke keeps a grant for each
			return cold(ctx, i)
		}},
		loop{kind: "refused", do: func(ctx context.Context, i int) error {
			time.Sleep(10 * time.Millisecond)
			return exchange(stranger, "target-0", nil)(ctx, i)
		}},
	)
	defer load.end()

	time.Sleep(min(total/20, 30*time.Second)) // warm up before the first figures
	startBroker, startAgent := settledUsage(t, f.brokerOpts.MetricsAddress), settledUsage(t, f.agentMetrics)
	start := time.Now()
	t.Logf("soak start: broker %s; agent %s", startBroker, startAgent)

	time.Sleep(time.Until(start.Add(total / 3)))
	restart := time.Now()
	f.restartBroker(t, syscall.SIGTERM)
	back := waitFor(t, time.Minute, "the agent to reconnect to the restarted broker", func(c assert.TestingT) {
		assert.Equal(c, 1.0, f.brokerMetric(t, "credbroker_connected_clusters"), "the broker process's credbroker_connected_clusters (-1: no scrape)")
	}, f.broker, f.agent)
	t.Logf("soak: broker restarted; ready and serving spoke-1 again %s after the SIGTERM", (time.Since(restart)).Round(10*time.Millisecond))
	_ = back

	time.Sleep(time.Until(start.Add(2 * total / 3)))
	restart = time.Now()
	f.restartAgent(t, syscall.SIGTERM)
	waitFor(t, time.Minute, "the restarted agent to connect", func(c assert.TestingT) {
		assert.Equal(c, 1.0, f.brokerMetric(t, "credbroker_connected_clusters"), "the broker process's credbroker_connected_clusters (-1: no scrape)")
	}, f.broker, f.agent)
	waitFor(t, time.Minute, "the restarted agent to serve", func(ct assert.TestingT) { c.assertServes(ct, spoke1, 0, mintTimeout) }, f.broker, f.agent)
	t.Logf("soak: agent restarted; serving again %s after the SIGTERM", (time.Since(restart)).Round(10*time.Millisecond))

	time.Sleep(time.Until(start.Add(total)))
	load.pause()
	waitFor(t, mintTimeout+5*time.Second, "no pending agent requests on the broker process", func(c assert.TestingT) {
		assert.Zero(c, f.brokerMetric(t, "credbroker_agent_requests_pending"), "the broker process's credbroker_agent_requests_pending (-1: no scrape)")
	}, f.broker, f.agent)
	endBroker, endAgent := settledUsage(t, f.brokerOpts.MetricsAddress), settledUsage(t, f.agentMetrics)
	m, err := framework.ScrapeMetrics(t.Context(), f.brokerOpts.MetricsAddress)
	require.NoError(t, err)
	t.Logf("soak for %s: broker start %s, end %s (a process restarted at a third); agent start %s, end %s (restarted at two thirds)",
		time.Since(start).Round(time.Second), startBroker, endBroker, startAgent, endAgent)
	t.Logf("soak calls by kind and code: %s", load.summary())
	t.Logf("soak: the restarted broker's credbroker_exchanges_total: %v", m.ByLabels("credbroker_exchanges_total"))

	load.mu.Lock()
	defer load.mu.Unlock()
	for kind, want := range map[string][]codes.Code{
		"cached":  {codes.OK, codes.Unavailable},
		"cold":    {codes.OK, codes.Unavailable},
		"refused": {codes.PermissionDenied, codes.Unavailable},
	} {
		require.NotEmpty(t, load.codes[kind], "no %s exchange ran", kind)
		for code := range load.codes[kind] {
			require.Contains(t, want, code, "a %s exchange", kind)
		}
	}
	require.LessOrEqual(t, endBroker.Goroutines, startBroker.Goroutines+churnGoroutineSlack, "the broker's goroutines grew")
	require.LessOrEqual(t, endAgent.Goroutines, startAgent.Goroutines+churnGoroutineSlack, "the agent's goroutines grew")
}

// restartBroker stops the broker process with sig and starts it again on
// the same ports.
func (f *procFleet) restartBroker(t *testing.T, sig syscall.Signal) {
	t.Helper()
	require.NoError(t, f.broker.Signal(sig))
	_ = f.broker.Wait()
	var err error
	f.broker, err = deployment.StartBrokerProcess(f.brokerOpts)
	require.NoError(t, err)
	waitFor(t, time.Minute, "the restarted broker process to be ready", func(c assert.TestingT) { assertReady(c, f.brokerOpts.MetricsAddress) }, f.broker)
}

// restartAgent stops the agent process with sig and starts it again.
func (f *procFleet) restartAgent(t *testing.T, sig syscall.Signal) {
	t.Helper()
	require.NoError(t, f.agent.Signal(sig))
	_ = f.agent.Wait()
	var err error
	f.agent, err = deployment.StartAgentProcess(context.Background(), spoke1, f.agentOpts)
	require.NoError(t, err)
}
