package tunnel

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/credbroker/credbroker/pkg/errdefs"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// hello opens a raw stream as id and waits until the broker admits it.
func (h *harness) hello(t *testing.T, id string) grpc.BidiStreamingClient[pb.AgentFrame, pb.BrokerFrame] {
	t.Helper()
	stream := h.rawStream(t, id)
	require.NoError(t, stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_Hello{Hello: &pb.Hello{}}}))
	md, err := stream.Header()
	require.NoError(t, err)
	require.NotEmpty(t, md.Get(admittedHeader), "the broker did not admit the stream")
	return stream
}

// leaveAtOnce makes an agent that stops close its stream without waiting
// for the requests in flight.
func leaveAtOnce(c *ClientConfig) { c.DrainTimeout = time.Millisecond }

func goodbye() *pb.AgentFrame {
	return &pb.AgentFrame{Body: &pb.AgentFrame_Goodbye{Goodbye: &pb.Goodbye{}}}
}

// A stream whose agent said goodbye gets no new request: every mint goes to
// the cluster's other stream. Were one routed to the leaving stream, which
// never answers here, it would time out.
func TestGoodbyeStreamGetsNoNewMint(t *testing.T) {
	h := newHarness(t, time.Second)
	leaving := h.hello(t, agentA)
	staying := &fakeMinter{}
	h.agent(t, agentA, staying)
	waitConnected(t, h, clusterA, 2)

	require.NoError(t, leaving.Send(goodbye()))
	require.Eventually(t, func() bool { return h.srv.Connected(clusterA) == 1 }, 5*time.Second, 5*time.Millisecond,
		"a stream whose agent said goodbye still counts as serving")
	for i := range 10 {
		_, err := h.srv.Mint(context.Background(), clusterA, &pb.MintRequest{})
		require.NoError(t, err, "mint %d", i)
	}
	assert.Equal(t, int32(10), staying.calls.Load())
}

// When every stream of a cluster said goodbye, a mint is Unavailable at
// once, so the consumer can try another replica.
func TestMintWithOnlyGoodbyeStreamsIsUnavailable(t *testing.T) {
	h := newHarness(t, 5*time.Second)
	leaving := h.hello(t, agentA)
	require.NoError(t, leaving.Send(goodbye()))
	waitConnected(t, h, clusterA, 0)
	_, err := h.srv.Mint(context.Background(), clusterA, &pb.MintRequest{})
	assert.Equal(t, codes.Unavailable, errdefs.Code(err))
}

// A mint sent before the goodbye is still answered after it.
func TestGoodbyeStreamFinishesMintsInFlight(t *testing.T) {
	h := newHarness(t, 5*time.Second)
	leaving := h.hello(t, agentA)
	waitConnected(t, h, clusterA, 1)
	type result struct {
		resp *pb.MintResponse
		err  error
	}
	done := make(chan result, 1)
	go func() {
		resp, err := h.srv.Mint(context.Background(), clusterA, &pb.MintRequest{})
		done <- result{resp, err}
	}()
	req, err := leaving.Recv()
	require.NoError(t, err)
	require.NotNil(t, req.GetMintRequest())
	require.NoError(t, leaving.Send(goodbye()))
	waitConnected(t, h, clusterA, 0)
	require.NoError(t, leaving.Send(&pb.AgentFrame{CorrelationId: req.GetCorrelationId(), Body: &pb.AgentFrame_MintResponse{
		MintResponse: &pb.MintResponse{Token: testToken, ExpirationTime: timestamppb.New(time.Unix(2e9, 0))},
	}}))
	r := <-done
	require.NoError(t, r.err)
	assert.Equal(t, testToken, r.resp.GetToken())
}

// A draining broker tells every stream, refuses new streams with
// Unavailable, still serves the mints of the exchanges in flight, and on
// Close ends its streams with Unavailable.
func TestDrainingServerTellsAgentsAndRefusesNewStreams(t *testing.T) {
	h := newHarness(t, 5*time.Second)
	stream := h.hello(t, agentA)
	waitConnected(t, h, clusterA, 1)

	h.srv.Drain()
	frames := make(chan *pb.BrokerFrame, 4)
	ended := make(chan error, 1)
	go func() {
		for {
			f, err := stream.Recv()
			if err != nil {
				ended <- err
				return
			}
			frames <- f
		}
	}()
	select {
	case f := <-frames:
		require.NotNil(t, f.GetDrain(), "the first frame after Drain is %v", f)
	case <-time.After(5 * time.Second):
		t.Fatal("a draining broker did not tell its agent")
	}

	refused := h.rawStream(t, agentA)
	_ = refused.Send(&pb.AgentFrame{Body: &pb.AgentFrame_Hello{Hello: &pb.Hello{}}})
	err := recvErr(t, refused)
	assert.Equal(t, codes.Unavailable, statusCode(err), "a draining broker admitted a new stream: %v", err)
	assert.Contains(t, err.Error(), "draining")

	// An exchange already in flight still mints on the draining stream.
	done := make(chan error, 1)
	go func() {
		_, err := h.srv.Mint(context.Background(), clusterA, &pb.MintRequest{})
		done <- err
	}()
	var req *pb.BrokerFrame
	select {
	case req = <-frames:
	case <-time.After(5 * time.Second):
		t.Fatal("a draining broker sent no mint down its stream")
	}
	require.NotNil(t, req.GetMintRequest())
	require.NoError(t, stream.Send(&pb.AgentFrame{CorrelationId: req.GetCorrelationId(), Body: &pb.AgentFrame_MintResponse{
		MintResponse: &pb.MintResponse{Token: testToken, ExpirationTime: timestamppb.New(time.Unix(2e9, 0))},
	}}))
	require.NoError(t, <-done)

	h.srv.Close()
	select {
	case err := <-ended:
		assert.Equal(t, codes.Unavailable, statusCode(err), "%v", err)
	case <-time.After(5 * time.Second):
		t.Fatal("Close left a stream open")
	}
}

// servingLog records a Client's Serving calls.
type servingLog struct {
	mu  sync.Mutex
	got []bool
}

func (s *servingLog) add(v bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.got = append(s.got, v)
}

func (s *servingLog) last() (bool, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.got) == 0 {
		return false, 0
	}
	return s.got[len(s.got)-1], len(s.got)
}

// An agent stops counting a draining broker as serving, yet answers the
// mints it still sends.
func TestClientStopsCountingADrainingBroker(t *testing.T) {
	h := newHarness(t, 5*time.Second)
	serving := &servingLog{}
	m := &fakeMinter{}
	h.agent(t, agentA, m, func(c *ClientConfig) { c.Serving = serving.add })
	waitConnected(t, h, clusterA, 1)
	require.Eventually(t, func() bool { v, _ := serving.last(); return v }, 5*time.Second, 5*time.Millisecond,
		"the agent did not report its admitted stream")

	h.srv.Drain()
	require.Eventually(t, func() bool { v, n := serving.last(); return !v && n == 2 }, 5*time.Second, 5*time.Millisecond,
		"the agent still counts a draining broker")
	_, err := h.srv.Mint(context.Background(), clusterA, &pb.MintRequest{})
	require.NoError(t, err)
	assert.Equal(t, int32(1), m.calls.Load())
}

// An agent that stops says goodbye at once, so that the broker sends it
// nothing new, and answers the mints in flight before it closes.
func TestClientSaysGoodbyeAndFinishesMintsInFlight(t *testing.T) {
	h := newHarness(t, 5*time.Second)
	started, release := make(chan struct{}), make(chan struct{})
	m := &fakeMinter{fn: func(ctx context.Context, _ *pb.MintRequest) (*pb.MintResponse, error) {
		close(started)
		select {
		case <-release:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		return &pb.MintResponse{Token: testToken, ExpirationTime: timestamppb.New(time.Unix(2e9, 0))}, nil
	}}
	_, stop := h.agent(t, agentA, m)
	waitConnected(t, h, clusterA, 1)

	done := make(chan error, 1)
	go func() {
		_, err := h.srv.Mint(context.Background(), clusterA, &pb.MintRequest{})
		done <- err
	}()
	<-started
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		stop()
	}()
	// The goodbye reaches the broker while the mint is still in flight.
	require.Eventually(t, func() bool { return h.srv.Connected(clusterA) == 0 }, 5*time.Second, 5*time.Millisecond,
		"the leaving agent's stream still counts as serving")
	close(release)
	require.NoError(t, <-done, "the agent dropped a mint in flight when it stopped")
	select {
	case <-stopped:
	case <-time.After(5 * time.Second):
		t.Fatal("the agent did not stop once its mints were answered")
	}
}

// A leaving agent waits for its mints no longer than DrainTimeout.
func TestClientDrainIsBounded(t *testing.T) {
	h := newHarness(t, time.Minute)
	started := make(chan struct{})
	canceled := make(chan struct{})
	m := &fakeMinter{fn: func(ctx context.Context, _ *pb.MintRequest) (*pb.MintResponse, error) {
		close(started)
		<-ctx.Done()
		close(canceled)
		return nil, ctx.Err()
	}}
	_, stop := h.agent(t, agentA, m, func(c *ClientConfig) { c.DrainTimeout = 50 * time.Millisecond; c.MintTimeout = time.Minute })
	waitConnected(t, h, clusterA, 1)
	go func() { _, _ = h.srv.Mint(context.Background(), clusterA, &pb.MintRequest{}) }()
	<-started
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		stop()
	}()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("a leaving agent waited past its drain timeout")
	}
	<-canceled
}

// After a broker says it drains, reconnects stay at the initial backoff for
// the maximum backoff, so that the agent finds the replica's replacement
// as soon as it listens; otherwise they double up to the maximum.
func TestBackoffStaysShortAfterADrain(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	b := backoff{initial: time.Second, max: 8 * time.Second}
	var waits []time.Duration
	for range 5 {
		waits = append(waits, b.cur)
		b.next(now)
	}
	assert.Equal(t, []time.Duration{0, 2 * time.Second, 4 * time.Second, 8 * time.Second, 8 * time.Second}, waits, "doubling up to the maximum")

	b.stayShort(now)
	for i := range 5 {
		wait := b.next(now.Add(time.Duration(i) * time.Second))
		assert.LessOrEqual(t, wait, time.Second, "short after a drain")
		assert.GreaterOrEqual(t, wait, time.Second/2)
	}
	b.next(now.Add(8 * time.Second))
	assert.Equal(t, 2*time.Second, b.cur, "doubling again once the window is over")

	b.reset()
	assert.Equal(t, time.Second, b.cur)
}
