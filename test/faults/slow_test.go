package faults

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
)

// TestSlowSpokeBlocksNoOtherCluster makes spoke-2 answer TokenRequests after
// 30s. Its consumers get DeadlineExceeded at the broker's mint timeout, and
// exchanges for spoke-1 meanwhile keep going: no head-of-line blocking
// across clusters, streams or consumers.
func TestSlowSpokeBlocksNoOtherCluster(t *testing.T) {
	const slowCalls, fastCalls = 8, 40
	slow := newCaller(t, slowCalls+1, spoke2)
	fast := newCaller(t, fastCalls*2, spoke1)
	waitFor(t, 30*time.Second, "the agents of both spokes", func(c assert.TestingT) { assertConnected(c, spoke1, 2); assertConnected(c, spoke2, 1) })

	// The baseline: cold exchanges for spoke-1, one after another.
	var before []time.Duration
	for i := range fastCalls {
		_, d, err := fast.exchange(spoke1, i, mintTimeout)
		require.NoError(t, err)
		before = append(before, d)
	}

	slowSpoke.Store(int64(30 * time.Second))
	t.Cleanup(func() { slowSpoke.Store(0) })
	var wg sync.WaitGroup
	slowCodes := make([]codes.Code, slowCalls)
	slowTook := make([]time.Duration, slowCalls)
	for i := range slowCalls {
		wg.Go(func() { slowCodes[i], slowTook[i], _ = slow.exchange(spoke2, i, 3*mintTimeout) })
	}
	// The same exchanges while spoke-2's mints hang.
	waitFor(t, mintTimeout, "the slow mints to reach the agent", func(c assert.TestingT) {
		assert.Equal(c, slowCalls, deployment.Broker.PendingAgentRequests(), "the broker's pending agent requests")
	})
	var during []time.Duration
	for i := fastCalls; i < 2*fastCalls; i++ {
		_, d, err := fast.exchange(spoke1, i, mintTimeout)
		require.NoError(t, err)
		during = append(during, d)
	}
	wg.Wait()
	for i, code := range slowCodes {
		require.Equal(t, codes.DeadlineExceeded, code, "slow call %d", i)
		require.Less(t, slowTook[i], 3*mintTimeout, "the broker's mint timeout must end the call, not the consumer's deadline")
	}
	t.Logf("slow spoke: %d calls to spoke-2 got DeadlineExceeded after %s–%s (--mint-timeout %s); spoke-1 cold exchanges p50/p99 %s/%s before, %s/%s during",
		slowCalls, percentile(slowTook, 0).Round(10*time.Millisecond), percentile(slowTook, 100).Round(10*time.Millisecond), mintTimeout,
		percentile(before, 50).Round(time.Millisecond), percentile(before, 99).Round(time.Millisecond),
		percentile(during, 50).Round(time.Millisecond), percentile(during, 99).Round(time.Millisecond))
	// While spoke-2 hung, no spoke-1 exchange waited anywhere near a mint
	// timeout: at most a few times the slowest exchange before it.
	require.Less(t, percentile(during, 100), mintTimeout/2)
	requireNoPendingMints(t)

	slowSpoke.Store(0)
	// The agent's own mint timeout frees its slots; then spoke-2 serves again.
	recovered := waitFor(t, time.Minute, "spoke-2 to serve again", func(c assert.TestingT) {
		slow.assertServes(c, spoke2, slowCalls, mintTimeout)
	})
	t.Logf("slow spoke: served again %s after it turned fast", recovered.Round(10*time.Millisecond))
}
