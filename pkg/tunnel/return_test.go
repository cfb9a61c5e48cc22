package tunnel

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/types"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// A mint for a cluster whose last stream ended less than ReturnWait ago
// waits for the agent to come back; one for a cluster that never had a
// stream, or whose last one ended longer ago, fails at once. The Server's
// clock times the wait.
func TestMintWaitsForAnAgentThatReturns(t *testing.T) {
	const wait = time.Minute
	tests := []struct {
		name string
		// before runs before the mint: the cluster's streams come and go.
		before func(t *testing.T, h *harness, clk *testingclock.FakeClock)
		// during runs while the mint is under way.
		during func(t *testing.T, h *harness, clk *testingclock.FakeClock)
		// waits: the mint does not end before during runs.
		waits bool
		ok    bool
	}{{
		name: "its stream ended, and the agent returns",
		before: func(t *testing.T, h *harness, _ *testingclock.FakeClock) {
			_, stop := h.agent(t, agentA, &fakeMinter{})
			waitConnected(t, h, clusterA, 1)
			stop()
			waitConnected(t, h, clusterA, 0)
		},
		during: func(t *testing.T, h *harness, _ *testingclock.FakeClock) { h.agent(t, agentA, &fakeMinter{}) },
		waits:  true,
		ok:     true,
	}, {
		name: "its stream ended, and no agent returns in time",
		before: func(t *testing.T, h *harness, _ *testingclock.FakeClock) {
			_, stop := h.agent(t, agentA, &fakeMinter{})
			waitConnected(t, h, clusterA, 1)
			stop()
			waitConnected(t, h, clusterA, 0)
		},
		during: func(_ *testing.T, _ *harness, clk *testingclock.FakeClock) { clk.Step(wait) },
		waits:  true,
	}, {
		name: "its stream ended, and the broker drains meanwhile",
		before: func(t *testing.T, h *harness, _ *testingclock.FakeClock) {
			_, stop := h.agent(t, agentA, &fakeMinter{})
			waitConnected(t, h, clusterA, 1)
			stop()
			waitConnected(t, h, clusterA, 0)
		},
		during: func(_ *testing.T, h *harness, _ *testingclock.FakeClock) { h.srv.Drain() },
		waits:  true,
	}, {
		name: "its stream ended because the broker is closing",
		before: func(t *testing.T, h *harness, _ *testingclock.FakeClock) {
			h.agent(t, agentA, &fakeMinter{})
			waitConnected(t, h, clusterA, 1)
			h.srv.Close()
			waitConnected(t, h, clusterA, 0)
		},
	}, {
		name:   "it never had a stream",
		before: func(*testing.T, *harness, *testingclock.FakeClock) {},
	}, {
		name: "its stream ended longer ago",
		before: func(t *testing.T, h *harness, clk *testingclock.FakeClock) {
			_, stop := h.agent(t, agentA, &fakeMinter{})
			waitConnected(t, h, clusterA, 1)
			stop()
			waitConnected(t, h, clusterA, 0)
			clk.Step(wait)
		},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clk := testingclock.NewFakeClock(time.Now())
			h := newHarness(t, 2*wait, func(cfg *ServerConfig) { cfg.Clock, cfg.ReturnWait = clk, wait })
			tt.before(t, h, clk)
			done := make(chan error, 1)
			go func() {
				_, err := h.srv.Mint(context.Background(), clusterA, &pb.MintRequest{})
				done <- err
			}()
			if tt.waits {
				assert.Never(t, func() bool { return len(done) > 0 }, 200*time.Millisecond, 10*time.Millisecond,
					"the mint ended before the agent could return")
				tt.during(t, h, clk)
			}
			var err error
			select {
			case err = <-done:
			case <-time.After(10 * time.Second):
				require.FailNow(t, "the mint did not end")
			}
			if tt.ok {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, errdefs.ErrUnavailable)
			assert.Contains(t, err.Error(), "no agent is connected for cluster fleet/a")
		})
	}
}

// What the Server keeps of the clusters whose last stream ended goes once
// ReturnWait has passed, at the next stream's end, so that clusters that
// come and go (ClusterProfiles created and deleted) leave nothing behind.
func TestGoneClustersAreForgotten(t *testing.T) {
	const wait = time.Minute
	clk := testingclock.NewFakeClock(time.Now())
	h := newHarness(t, 2*wait, func(cfg *ServerConfig) { cfg.Clock, cfg.ReturnWait = clk, wait })
	clusterB := fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: "fleet", Name: "b"}, UID: "uid-b"}
	agentB := "spiffe://test.example/clusterprofile/fleet/b"
	h.resolver.set(agentB, &clusterB)
	comeAndGo := func(id string, c fleet.ClusterRef) {
		_, stop := h.agent(t, id, &fakeMinter{})
		waitConnected(t, h, c, 1)
		stop()
		waitConnected(t, h, c, 0)
	}
	kept := func() (gone, arrived int) {
		h.srv.mu.RLock()
		defer h.srv.mu.RUnlock()
		return len(h.srv.gone), len(h.srv.arrived)
	}

	comeAndGo(agentA, clusterA)
	done := make(chan error, 1)
	go func() {
		_, err := h.srv.Mint(context.Background(), clusterA, &pb.MintRequest{})
		done <- err
	}()
	require.Eventually(t, func() bool { _, arrived := kept(); return arrived == 1 }, 10*time.Second, time.Millisecond)
	clk.Step(wait)
	require.ErrorIs(t, <-done, errdefs.ErrUnavailable)

	comeAndGo(agentB, clusterB)
	gone, arrived := kept()
	assert.Equal(t, 1, gone, "only cluster b's end is kept")
	assert.Zero(t, arrived)
}
