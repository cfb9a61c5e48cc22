package faults

import (
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	"github.com/credbroker/credbroker/pkg/agent"
	"github.com/credbroker/credbroker/test/framework"
)

// TestAgentKilledWithMintsInFlight runs a third agent of spoke-1 as the
// shipped spoke-agent binary, holds 100 mints on it (its spoke stalls), and
// SIGKILLs it. Every mint gets an answer within its deadline: those on the
// killed agent's stream move to the cluster's other agents. None stays
// pending.
func TestAgentKilledWithMintsInFlight(t *testing.T) {
	const mints = 100
	c := newCaller(t, mints, spoke1)
	stalled, err := proxyTo(spoke1.Server)
	require.NoError(t, err)
	defer stalled.Close()
	p, err := deployment.StartAgentProcess(t.Context(), spoke1, framework.AgentProcessOptions{
		Bin: agentBin, SpokeServer: "https://" + stalled.Addr(),
		// Mints of the deployment's tests on spoke-1 must fail fast when
		// this agent's spoke stalls.
		Args: []string{"--mint-timeout=" + (3 * mintTimeout).String()},
	})
	require.NoError(t, err)
	t.Cleanup(p.Stop)
	waitFor(t, time.Minute, "the agent process to connect", func(c assert.TestingT) { assertConnected(c, spoke1, 3) }, p)

	stalled.Partition()
	deadline := 2 * mintTimeout
	var wg sync.WaitGroup
	codesSeen := make([]codes.Code, mints)
	took := make([]time.Duration, mints)
	for i := range mints {
		wg.Go(func() { codesSeen[i], took[i], _ = c.exchange(spoke1, i, deadline) })
	}
	// The two in-process agents answer theirs at once; about a third wait
	// on the stalled agent.
	waitFor(t, mintTimeout, "mints held by the stalled agent", func(c assert.TestingT) {
		assert.GreaterOrEqual(c, deployment.Broker.PendingAgentRequests(), mints/5, "the broker's pending agent requests")
	}, p)
	pending := deployment.Broker.PendingAgentRequests()
	require.NoError(t, p.Signal(syscall.SIGKILL))
	killed := time.Now()
	wg.Wait()
	for i, code := range codesSeen {
		require.Equal(t, codes.OK, code, "mint %d, after %s", i, took[i])
		require.Less(t, took[i], deadline)
	}
	t.Logf("agent killed: %d of %d mints were pending; all answered by the other agents, the last %s after the kill",
		pending, mints, time.Since(killed).Round(10*time.Millisecond))
	requireNoPendingMints(t)
	require.Equal(t, 2, connected(spoke1))
}

// TestBrokerKilledAndRestarted runs a second broker replica as the shipped
// broker binary, SIGKILLs it and starts it again on the same ports. The
// agents reconnect within their backoff bound, and consumers of the other
// replica see nothing meanwhile.
func TestBrokerKilledAndRestarted(t *testing.T) {
	ctx := t.Context()
	opts := replicaOptions(t)
	p, err := deployment.StartBrokerProcess(opts)
	require.NoError(t, err)
	t.Cleanup(func() { p.Stop() })
	// An agent of spoke-2 with a stream to each replica.
	stop, err := deployment.StartAgentWith(ctx, spoke2, framework.AgentOptions{
		ID: framework.AgentID(spoke2.Name),
		Tune: func(c *agent.Config) {
			c.BrokerAddresses = []string{deployment.Broker.AgentAddr(), opts.AgentAddress}
			c.InitialBackoff, c.MaxBackoff = 100*time.Millisecond, 2*time.Second
		},
	})
	require.NoError(t, err)
	t.Cleanup(stop)

	c := newCaller(t, 2, spoke2)
	viaProcess, conn, err := deployment.ExchangeClient(opts.ExchangeAddress)
	require.NoError(t, err)
	defer conn.Close()
	other := &caller{Consumer: c.Consumer, client: viaProcess, targetNS: c.targetNS, targets: c.targets}
	serves := func(c assert.TestingT) { other.assertServes(c, spoke2, 1, mintTimeout) }
	waitFor(t, time.Minute, "the broker process to serve spoke-2", serves, p)

	// Load on the in-process replica while the other dies and comes back.
	var (
		wg     sync.WaitGroup
		done   = make(chan struct{})
		calls  int
		failed []error
	)
	wg.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-done:
				return
			default:
			}
			if _, _, err := c.exchange(spoke2, i%2, mintTimeout); err != nil {
				failed = append(failed, err)
			}
			calls++
		}
	})

	require.NoError(t, p.Signal(syscall.SIGKILL))
	require.Error(t, p.Wait())
	p, err = deployment.StartBrokerProcess(opts)
	require.NoError(t, err)
	reconnected := waitFor(t, time.Minute, "the agent to reconnect to the restarted broker", serves, p)
	close(done)
	wg.Wait()
	require.Empty(t, failed, "consumers of the other replica must see nothing")
	t.Logf("broker killed: restarted on the same ports, served spoke-2 again %s later (agent backoff at most 2s, plus the broker's start); "+
		"%d exchanges on the other replica meanwhile, 0 failed", reconnected.Round(10*time.Millisecond), calls)
}
