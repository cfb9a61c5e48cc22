package tunnel

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/credbroker/credbroker/pkg/fleet"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// streams counts every session of cluster, draining ones too.
func (h *harness) streams(c fleet.ClusterRef) int {
	h.srv.mu.RLock()
	defer h.srv.mu.RUnlock()
	return len(h.srv.sessions[c.NamespacedName])
}

// After Rotate, the agent opens a stream with its new SVID before it
// closes the old one, new requests go to the new stream, and the old one
// answers the request it holds before it closes.
func TestRotationOpensTheNewStreamBeforeDrainingTheOld(t *testing.T) {
	h := newHarness(t, 5*time.Second)
	slowStarted, release := make(chan struct{}), make(chan struct{})
	m := &fakeMinter{fn: func(ctx context.Context, req *pb.MintRequest) (*pb.MintResponse, error) {
		if req.GetAudiences()[0] == "slow" {
			close(slowStarted)
			select {
			case <-release:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
		return &pb.MintResponse{Token: testToken, ExpirationTime: timestamppb.New(time.Unix(2e9, 0))}, nil
	}}
	c, _ := h.agent(t, agentA, m)
	waitConnected(t, h, clusterA, 1)

	// Watch for a moment without a stream that takes requests.
	var gaps atomic.Int32
	watchCtx, stopWatch := context.WithCancel(context.Background())
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		for watchCtx.Err() == nil {
			if h.srv.Connected(clusterA) == 0 {
				gaps.Add(1)
			}
			time.Sleep(time.Millisecond)
		}
	}()

	slow := make(chan error, 1)
	go func() {
		_, err := h.srv.Mint(context.Background(), clusterA, &pb.MintRequest{Audiences: []string{"slow"}})
		slow <- err
	}()
	<-slowStarted
	old := h.srv.live(clusterA)[0]

	h.peers.setSVID(agentA, time.Hour) // the rotated SVID
	c.Rotate()
	require.Eventually(t, func() bool { return h.streams(clusterA) == 2 }, 10*time.Second, time.Millisecond, "the new stream is opened")
	live := h.srv.live(clusterA)
	require.Len(t, live, 1)
	assert.NotSame(t, old, live[0], "new requests go to the new stream")
	for range 5 {
		_, err := h.srv.Mint(context.Background(), clusterA, &pb.MintRequest{Audiences: []string{"fast"}})
		require.NoError(t, err)
	}
	assert.Equal(t, 2, h.streams(clusterA), "the old stream stays while it holds a request")

	close(release)
	require.NoError(t, <-slow, "the old stream answers the request it held")
	require.Eventually(t, func() bool { return h.streams(clusterA) == 1 }, 10*time.Second, time.Millisecond, "the old stream is drained")
	assert.Same(t, live[0], h.srv.live(clusterA)[0])
	stopWatch()
	<-watched
	assert.Zero(t, gaps.Load(), "the cluster was without a stream during the rotation")
}

// instanceStream opens a Connect stream as agent id that names itself
// instance, and waits for its admission.
func (h *harness) instanceStream(t *testing.T, id, instance string) {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///bufnet",
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return h.lis.DialContext(ctx) }))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ctx := metadata.AppendToOutgoingContext(context.Background(), "test-agent-id", id, instanceHeader, instance)
	stream, err := pb.NewAgentTunnelClient(conn).Connect(ctx)
	require.NoError(t, err)
	require.NoError(t, stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_Hello{Hello: &pb.Hello{}}}))
	md, err := stream.Header()
	require.NoError(t, err)
	require.NotEmpty(t, md.Get(admittedHeader))
}

// Attack: an agent names itself with the instance of another agent's
// stream, to have the broker treat its own stream as that stream's
// replacement and send it no more work. Only a stream of the same SPIFFE
// ID replaces another.
func TestAnotherAgentCannotReplaceAStream(t *testing.T) {
	h := newHarness(t, time.Second, func(cfg *ServerConfig) { cfg.MaxStreamsPerCluster = 8 })
	agentA2 := "spiffe://test.example/custom/a2" // another ID mapped to fleet/a
	h.resolver.set(agentA2, &clusterA)

	h.instanceStream(t, agentA, "victim")
	waitConnected(t, h, clusterA, 1)
	h.instanceStream(t, agentA2, "victim")
	waitConnected(t, h, clusterA, 2)
	assert.Equal(t, 2, h.streams(clusterA))

	// The same agent's new stream does replace its old one.
	h.instanceStream(t, agentA, "victim")
	require.Eventually(t, func() bool { return h.streams(clusterA) == 3 }, 10*time.Second, time.Millisecond)
	assert.Equal(t, 2, h.srv.Connected(clusterA))
}
