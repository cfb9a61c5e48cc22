package faults

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestPartitionWithoutReset cuts agent A's path to the broker without a
// TCP reset, while mints run. The broker's keepalive ends A's stream within
// --agent-keepalive-time + --agent-keepalive-timeout; the mints that were
// sent down it move to agent B's stream, so every consumer call succeeds,
// none outlives its deadline, and once healed A is back on its own.
func TestPartitionWithoutReset(t *testing.T) {
	const mints = 12
	c := newCaller(t, mints+1, spoke1)
	waitFor(t, 30*time.Second, "both agents of spoke-1", func(c assert.TestingT) { assertConnected(c, spoke1, 2) })

	agentProxy.Partition()
	t.Cleanup(agentProxy.Heal)
	partitioned := time.Now()

	deadline := 2 * mintTimeout
	var wg sync.WaitGroup
	took := make([]time.Duration, mints)
	errs := make([]error, mints)
	for i := range mints {
		wg.Go(func() { _, took[i], errs[i] = c.exchange(spoke1, i, deadline) })
	}
	detected := waitFor(t, mintTimeout, "the broker to end the partitioned stream", func(c assert.TestingT) { assertConnected(c, spoke1, 1) })
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "mint %d, after %s", i, took[i])
		require.Less(t, took[i], deadline)
	}
	t.Logf("partition: the broker ended the silent stream %s after the cut (bound %s + %s); %d mints, slowest %s, all answered by the other agent",
		detected.Round(10*time.Millisecond), keepaliveTime, keepaliveTimeout, mints, percentile(took, 100).Round(10*time.Millisecond))
	requireNoPendingMints(t)

	agentProxy.Heal()
	recovered := waitFor(t, time.Minute, "agent A to reconnect", func(c assert.TestingT) { assertConnected(c, spoke1, 2) })
	t.Logf("partition: healed after %s; agent A reconnected %s later", time.Since(partitioned).Round(10*time.Millisecond), recovered.Round(10*time.Millisecond))
	code, _, err := c.exchange(spoke1, mints, deadline)
	require.NoError(t, err, "code %s", code)
}
