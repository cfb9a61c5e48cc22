package faults

import (
	"context"
	"fmt"
	"sort"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

var seq atomic.Int64

// unique returns a name no other test uses.
func unique(prefix string) string { return fmt.Sprintf("%s-%d", prefix, seq.Add(1)) }

// caller is a consumer with a TokenExchange client of the broker, and
// spoke ServiceAccounts it may get tokens for.
type caller struct {
	framework.Consumer
	client pb.TokenExchangeClient
	// targets are spoke ServiceAccounts, each in targetNS, that the
	// consumer may get tokens for, by spoke name: a mint for each one that
	// is not cached yet.
	targetNS string
	targets  map[string][]string
}

// newCaller creates a consumer allowed on the given spokes, with n spoke
// ServiceAccounts on each that it may get tokens for.
func newCaller(t *testing.T, n int, spokes ...*framework.Cluster) *caller {
	t.Helper()
	ctx := t.Context()
	var names []string
	for _, s := range spokes {
		names = append(names, s.Name)
	}
	c, err := env.NewConsumer(ctx, unique("hub"), "consumer", "credbroker", names...)
	require.NoError(t, err)
	client, conn, err := deployment.ExchangeClient(deployment.Broker.ExchangeAddr())
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	cl := &caller{Consumer: c, client: client, targetNS: unique("spoke"), targets: map[string][]string{}}
	for _, s := range spokes {
		require.NoError(t, s.EnsureNamespace(ctx, cl.targetNS))
		for i := range n {
			name := fmt.Sprintf("target-%d", i)
			require.NoError(t, deployment.OptIn(ctx, s, cl.targetNS, name, c.Username()))
			cl.targets[s.Name] = append(cl.targets[s.Name], name)
		}
	}
	return cl
}

// exchange asks for a token for the i-th target on spoke, within deadline,
// and returns the call's code, how long it took and its error.
func (c *caller) exchange(spoke *framework.Cluster, i int, deadline time.Duration) (codes.Code, time.Duration, error) {
	ctx, cancel := context.WithTimeout(c.Context(context.Background()), deadline)
	defer cancel()
	start := time.Now()
	_, err := c.client.Exchange(ctx, &pb.ExchangeRequest{
		Cluster:        &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: spoke.Name},
		ServiceAccount: &pb.ObjectReference{Namespace: c.targetNS, Name: c.targets[spoke.Name][i]},
	})
	return status.Code(err), time.Since(start), err
}

// waitFor calls cond every 50ms, for up to timeout, until it makes no
// failed assertion on c, and returns how long that took. On timeout the
// test fails with what, cond's last failed assertions (what it saw last)
// and the last lines of procs' output (framework.Eventually).
func waitFor(t *testing.T, timeout time.Duration, what string, cond func(c assert.TestingT), procs ...*framework.Process) time.Duration {
	t.Helper()
	return framework.Eventually(t, timeout, 50*time.Millisecond, what, cond, procs...)
}

// requireNoPendingMints waits until no mint or revoke waits for an agent
// (credbroker_agent_requests_pending is 0).
func requireNoPendingMints(t *testing.T) {
	t.Helper()
	waitFor(t, mintTimeout+5*time.Second, "no pending agent requests", func(c assert.TestingT) {
		assert.Zero(c, deployment.Broker.PendingAgentRequests(), "the broker's pending agent requests")
	})
}

// connected is the number of agent streams that serve spoke.
func connected(spoke *framework.Cluster) int {
	return deployment.Broker.Connected(framework.FleetNamespace, spoke.Name)
}

// assertConnected states that n agent streams serve spoke.
func assertConnected(c assert.TestingT, spoke *framework.Cluster, n int) bool {
	return assert.Equal(c, n, connected(spoke), "agent streams of %s on the broker", spoke.Name)
}

// assertServes states that c's exchange for its i-th target on spoke, within
// deadline, succeeds.
func (c *caller) assertServes(ct assert.TestingT, spoke *framework.Cluster, i int, deadline time.Duration) bool {
	_, took, err := c.exchange(spoke, i, deadline)
	return assert.NoError(ct, err, "exchange for target %d of %s (after %s)", i, spoke.Name, took.Round(time.Millisecond))
}

// percentile returns the p-th percentile (0–100) of ds.
func percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[min(len(s)-1, int(float64(len(s))*p/100))]
}

// replicaOptions returns the options of another broker replica, the
// shipped binary on free addresses.
func replicaOptions(t *testing.T) framework.BrokerProcessOptions {
	t.Helper()
	opts := framework.BrokerProcessOptions{Bin: brokerBin}
	for _, p := range []*string{&opts.ExchangeAddress, &opts.AgentAddress, &opts.MetricsAddress} {
		var err error
		*p, err = framework.FreeAddr()
		require.NoError(t, err)
	}
	return opts
}
