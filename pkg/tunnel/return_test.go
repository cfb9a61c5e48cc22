package tunnel

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
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
			waitEnded(t, h, clusterA)
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
			waitEnded(t, h, clusterA)
		},
		during: func(_ *testing.T, _ *harness, clk *testingclock.FakeClock) { clk.Step(wait) },
		waits:  true,
	}, {
		name: "its stream ended, and the broker drains meanwhile",
		before: func(t *testing.T, h *harness, _ *testingclock.FakeClock) {
			_, stop := h.agent(t, agentA, &fakeMinter{})
			waitConnected(t, h, clusterA, 1)
			stop()
			waitEnded(t, h, clusterA)
		},
		during: func(_ *testing.T, h *harness, _ *testingclock.FakeClock) { h.srv.Drain() },
		waits:  true,
	}, {
		name: "its stream ended because the broker is closing",
		before: func(t *testing.T, h *harness, _ *testingclock.FakeClock) {
			h.agent(t, agentA, &fakeMinter{})
			waitConnected(t, h, clusterA, 1)
			h.srv.Close()
			waitEnded(t, h, clusterA)
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
			waitEnded(t, h, clusterA)
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
		waitEnded(t, h, c)
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

// gatedResolver is its inner Resolver, except that every call after the
// first pass holds until open is closed, and tells entered when it starts.
type gatedResolver struct {
	inner   Resolver
	pass    atomic.Int32
	entered chan struct{}
	open    chan struct{}
}

// newGatedResolver returns a gatedResolver that lets every call pass, and
// a tune for newHarness that puts it in front of the harness's resolver.
func newGatedResolver() (*gatedResolver, func(*ServerConfig)) {
	gate := &gatedResolver{entered: make(chan struct{}, 1), open: make(chan struct{})}
	gate.pass.Store(1 << 20)
	return gate, func(cfg *ServerConfig) { gate.inner, cfg.Resolver = cfg.Resolver, gate }
}

// refusedAfterHello opens a stream of agentA whose admission passes, holds
// the check after its hello, runs whileHeld, then has agentA's
// ClusterProfile no longer accept it and lets the check go on; it returns
// what the stream then receives.
func refusedAfterHello(t *testing.T, h *harness, gate *gatedResolver, whileHeld func()) (*pb.BrokerFrame, error) {
	t.Helper()
	gate.pass.Store(1)
	stream := h.rawStream(t, agentA)
	require.NoError(t, stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_Hello{Hello: &pb.Hello{}}}))
	select {
	case <-gate.entered:
	case <-time.After(10 * time.Second):
		require.FailNow(t, "the broker did not check the stream after its hello")
	}
	whileHeld()
	h.resolver.set(agentA, nil)
	gate.pass.Store(1 << 20)
	close(gate.open)
	return stream.Recv()
}

func (r *gatedResolver) ResolveAgent(id spiffeid.ID) (fleet.ClusterRef, error) {
	if r.pass.Add(-1) < 0 {
		r.entered <- struct{}{}
		<-r.open
	}
	return r.inner.ResolveAgent(id)
}

// A stream takes requests only once the checks after its hello pass: one
// whose agent no longer maps to the cluster by then (its ClusterProfile
// changed, or its SVID was revoked, while the broker awaited the hello)
// never counts as the cluster's agent, and a mint waiting for the cluster's
// agent to return is not sent down it, but to the agent that does return.
func TestStreamServesOnlyOnceItsChecksPass(t *testing.T) {
	gate, gated := newGatedResolver()
	h := newHarness(t, time.Minute, gated, func(cfg *ServerConfig) { cfg.ReturnWait = 30 * time.Second })
	_, stop := h.agent(t, agentA, &fakeMinter{})
	waitConnected(t, h, clusterA, 1)
	stop()
	waitEnded(t, h, clusterA)
	done := make(chan error, 1)
	go func() {
		_, err := h.srv.Mint(context.Background(), clusterA, &pb.MintRequest{})
		done <- err
	}()

	// The stream's admission passes; the check after its hello holds
	// until the agent's ClusterProfile no longer accepts it.
	f, err := refusedAfterHello(t, h, gate, func() {
		assert.Never(t, func() bool { return h.srv.Connected(clusterA) > 0 }, 200*time.Millisecond, 5*time.Millisecond,
			"a stream counted as the cluster's agent before its checks passed")
	})
	require.Error(t, err, "the refused stream was sent %v", f)
	assert.Equal(t, codes.PermissionDenied, status.Code(err))

	h.resolver.set(agentA, &clusterA)
	h.agent(t, agentA, &fakeMinter{})
	require.NoError(t, <-done, "the mint did not go to the agent that returned")
}

// serverStream is an agent stream as Connect sees it: Send records each
// frame, and Recv waits for the stream to end.
type serverStream struct {
	grpc.ServerStream
	ctx  context.Context
	mu   sync.Mutex
	sent []*pb.BrokerFrame
}

func (s *serverStream) Context() context.Context { return s.ctx }

func (s *serverStream) Send(f *pb.BrokerFrame) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sent = append(s.sent, f)
	return nil
}

func (s *serverStream) Recv() (*pb.AgentFrame, error) {
	<-s.ctx.Done()
	return nil, s.ctx.Err()
}

// A session closed with requests still queued for it, as when its agent is
// refused after they were queued, sends none of them: its agent may be
// the one refused. serve picks among the ready cases at random, so the
// test asks many times.
func TestClosedSessionSendsNoQueuedRequest(t *testing.T) {
	h := newHarness(t, time.Minute)
	for range 32 {
		ctx, cancel := context.WithCancel(context.Background())
		stream := &serverStream{ctx: ctx}
		sctx, refuse := context.WithCancelCause(ctx)
		sess := &session{cluster: clusterA, log: logr.Discard(), out: make(chan *pb.BrokerFrame, 16), ctx: sctx, cancel: refuse}
		for range cap(sess.out) {
			sess.out <- &pb.BrokerFrame{CorrelationId: "queued", Body: &pb.BrokerFrame_MintRequest{MintRequest: &pb.MintRequest{}}}
		}
		refuse(fmt.Errorf("agent refused: %w", errdefs.ErrPermissionDenied))
		_, err := h.srv.serve(stream, sess)
		cancel()
		require.Equal(t, codes.PermissionDenied, status.Code(err))
		require.Empty(t, stream.sent, "a closed session sent what was queued for it")
	}
}

// A stream refused after its hello was never the cluster's agent: its end
// does not make the cluster's mints wait for an agent to return.
func TestRefusedStreamIsNoAgentToWaitFor(t *testing.T) {
	const wait = time.Minute
	clk := testingclock.NewFakeClock(time.Now())
	gate, gated := newGatedResolver()
	h := newHarness(t, 2*wait, gated, func(cfg *ServerConfig) { cfg.Clock, cfg.ReturnWait = clk, wait })
	_, stop := h.agent(t, agentA, &fakeMinter{})
	waitConnected(t, h, clusterA, 1)
	stop()
	waitEnded(t, h, clusterA)
	clk.Step(wait)

	_, err := refusedAfterHello(t, h, gate, func() {})
	require.Equal(t, codes.PermissionDenied, status.Code(err))

	done := make(chan error, 1)
	go func() {
		_, err := h.srv.Mint(context.Background(), clusterA, &pb.MintRequest{})
		done <- err
	}()
	select {
	case err := <-done:
		require.ErrorIs(t, err, errdefs.ErrUnavailable)
	case <-time.After(10 * time.Second):
		require.FailNow(t, "the mint waits for the refused stream's agent to return")
	}
}
