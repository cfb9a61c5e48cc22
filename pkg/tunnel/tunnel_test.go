package tunnel

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/apimachinery/pkg/types"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/credbroker/credbroker/internal/testing/testpki"
	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

const testToken = "eyJhbGciOiJSUzI1NiJ9.eyJqdGkiOiJiMWYzIn0.c2ln"

// fakeResolver admits the agents listed in clusters.
type fakeResolver struct {
	mu       sync.Mutex
	clusters map[string]fleet.ClusterRef
}

func (r *fakeResolver) ResolveAgent(id spiffeid.ID) (fleet.ClusterRef, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	c, ok := r.clusters[id.String()]
	if !ok {
		return fleet.ClusterRef{}, fmt.Errorf("no ClusterProfile accepts agent %s: %w", id, errdefs.ErrPermissionDenied)
	}
	return c, nil
}

func (r *fakeResolver) set(id string, c *fleet.ClusterRef) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if c == nil {
		delete(r.clusters, id)
	} else {
		r.clusters[id] = *c
	}
}

// peers stands in for the mTLS handshake: the in-memory tests put the
// agent's ID in metadata, and the agent's SVID is one that ca issued for
// that ID, for an hour unless the test set another.
type peers struct {
	ca *testpki.CA
	mu sync.Mutex
	// chains holds each agent's SVID, issued on first use.
	chains map[string][]*x509.Certificate
}

func (p *peers) peer(ctx context.Context) (spiffeid.ID, []*x509.Certificate, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	v := md.Get("test-agent-id")
	if len(v) != 1 {
		return spiffeid.ID{}, nil, fmt.Errorf("no peer: %w", errdefs.ErrUnauthenticated)
	}
	id, err := spiffeid.FromString(v[0])
	if err != nil {
		return spiffeid.ID{}, nil, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.chains[v[0]] == nil {
		p.chains[v[0]] = p.issue(v[0], time.Hour)
	}
	return id, p.chains[v[0]], nil
}

func (p *peers) issue(id string, ttl time.Duration) []*x509.Certificate {
	certPEM, _, err := p.ca.IssueSVID(id, ttl)
	if err != nil {
		panic(err)
	}
	block, _ := pem.Decode(certPEM)
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		panic(err)
	}
	return []*x509.Certificate{cert}
}

// setSVID makes id present an SVID valid for ttl from now.
func (p *peers) setSVID(id string, ttl time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.chains[id] = p.issue(id, ttl)
}

// fakeMinter answers with fn, or a fixed token, and records the cluster
// of every mint.
type fakeMinter struct {
	calls atomic.Int32
	fn    func(ctx context.Context, req *pb.MintRequest) (*pb.MintResponse, error)

	mu       sync.Mutex
	clusters []fleet.ClusterRef
}

// admitted returns the cluster of every mint so far.
func (m *fakeMinter) admitted() []fleet.ClusterRef {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.clusters)
}

func (m *fakeMinter) Mint(ctx context.Context, cluster fleet.ClusterRef, req *pb.MintRequest) (*pb.MintResponse, error) {
	m.calls.Add(1)
	m.mu.Lock()
	m.clusters = append(m.clusters, cluster)
	m.mu.Unlock()
	if m.fn != nil {
		return m.fn(ctx, req)
	}
	return &pb.MintResponse{Token: testToken, ExpirationTime: timestamppb.New(time.Unix(2e9, 0))}, nil
}

var (
	clusterA = fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: "fleet", Name: "a"}, UID: "uid-a"}
	agentA   = "spiffe://test.example/clusterprofile/fleet/a"
)

type harness struct {
	srv      *Server
	resolver *fakeResolver
	peers    *peers
	bundles  *x509bundle.Set
	lis      *bufconn.Listener
}

func newHarness(t *testing.T, mintTimeout time.Duration, tune ...func(*ServerConfig)) *harness {
	t.Helper()
	ca, err := testpki.NewCA("test.example")
	require.NoError(t, err)
	h := &harness{
		resolver: &fakeResolver{clusters: map[string]fleet.ClusterRef{agentA: clusterA}},
		peers:    &peers{ca: ca, chains: map[string][]*x509.Certificate{}},
		bundles:  x509bundle.NewSet(x509bundle.FromX509Authorities(ca.TrustDomain(), []*x509.Certificate{ca.Certificate()})),
	}
	cfg := ServerConfig{Resolver: h.resolver, Peer: h.peers.peer, Bundles: h.bundles, MintTimeout: mintTimeout, MaxStreamsPerCluster: 2}
	for _, f := range tune {
		f(&cfg)
	}
	h.srv, err = NewServer(cfg)
	require.NoError(t, err)
	lis := bufconn.Listen(1 << 20)
	// The broker's message limit; fixed windows, so that a broker that does
	// not read holds up its agent's sends after 64 KiB.
	g := grpc.NewServer(grpc.MaxRecvMsgSize(64<<10), grpc.InitialWindowSize(64<<10), grpc.InitialConnWindowSize(64<<10))
	pb.RegisterAgentTunnelServer(g, h.srv)
	go func() { _ = g.Serve(lis) }()
	t.Cleanup(g.Stop)
	h.lis = lis
	return h
}

// agent starts a Client that presents id, and returns it with a stop func.
func (h *harness) agent(t *testing.T, id string, m Minter, tune ...func(*ClientConfig)) (*Client, context.CancelFunc) {
	t.Helper()
	cfg := ClientConfig{
		Address:        "passthrough:///bufnet",
		Credentials:    insecure.NewCredentials(),
		Minter:         m,
		Hello:          &pb.Hello{AgentVersion: "test"},
		InitialBackoff: 10 * time.Millisecond,
		MaxBackoff:     50 * time.Millisecond,
		DialOptions: []grpc.DialOption{
			grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return h.lis.DialContext(ctx) }),
			grpc.WithStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
				return streamer(metadata.AppendToOutgoingContext(ctx, "test-agent-id", id), desc, cc, method, opts...)
			}),
		},
	}
	for _, f := range tune {
		f(&cfg)
	}
	c, err := NewClient(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	stop := func() {
		cancel()
		require.NoError(t, <-done)
	}
	t.Cleanup(func() {
		if ctx.Err() == nil {
			stop()
		}
	})
	return c, stop
}

// rawStream opens a Connect stream as agent id, without the Client.
func (h *harness) rawStream(t *testing.T, id string) grpc.BidiStreamingClient[pb.AgentFrame, pb.BrokerFrame] {
	t.Helper()
	return h.rawStreamContext(t, context.Background(), id)
}

// rawStreamContext is rawStream on a stream that ends with ctx.
func (h *harness) rawStreamContext(t *testing.T, ctx context.Context, id string) grpc.BidiStreamingClient[pb.AgentFrame, pb.BrokerFrame] {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///bufnet",
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return h.lis.DialContext(ctx) }))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	stream, err := pb.NewAgentTunnelClient(conn).Connect(metadata.AppendToOutgoingContext(ctx, "test-agent-id", id))
	require.NoError(t, err)
	return stream
}

func waitConnected(t *testing.T, h *harness, c fleet.ClusterRef, n int) {
	t.Helper()
	require.Eventually(t, func() bool { return h.srv.Connected(c) == n }, 10*time.Second, 5*time.Millisecond)
}

// waitEnded waits until the server has removed every stream of c and, with
// ReturnWait, recorded when the last one ended. Connected drops to 0 as a
// stream's context ends, a moment before that: a test that moved a fake
// clock, or started a mint, once Connected was 0 raced the record, and
// failed one run of the flake hunt (docs/testing.md).
func waitEnded(t *testing.T, h *harness, c fleet.ClusterRef) {
	t.Helper()
	require.Eventually(t, func() bool {
		h.srv.mu.RLock()
		defer h.srv.mu.RUnlock()
		_, ok := h.srv.sessions[c.NamespacedName]
		return !ok
	}, 10*time.Second, 5*time.Millisecond, "the server still holds a stream of %s", c)
}

func TestMintRoundTrip(t *testing.T) {
	h := newHarness(t, 5*time.Second)
	var got *pb.MintRequest
	m := &fakeMinter{fn: func(ctx context.Context, req *pb.MintRequest) (*pb.MintResponse, error) {
		got = req
		return &pb.MintResponse{Token: testToken, ExpirationTime: timestamppb.New(time.Unix(2e9, 0))}, nil
	}}
	h.agent(t, agentA, m)
	waitConnected(t, h, clusterA, 1)

	req := &pb.MintRequest{Subject: &pb.Subject{Username: "system:serviceaccount:hub:c"}, Audiences: []string{"x"}}
	resp, err := h.srv.Mint(context.Background(), clusterA, req)
	require.NoError(t, err)
	assert.Equal(t, testToken, resp.GetToken())
	assert.Equal(t, "system:serviceaccount:hub:c", got.GetSubject().GetUsername())
	assert.Equal(t, []string{"x"}, got.GetAudiences())
	assert.Equal(t, []fleet.ClusterRef{clusterA}, m.admitted(),
		"the Minter must learn the ClusterProfile the broker admitted the stream for, and the UID of its incarnation, which the grant records")
}

func TestMintErrors(t *testing.T) {
	tests := []struct {
		name     string
		minter   func(context.Context, *pb.MintRequest) (*pb.MintResponse, error)
		cluster  fleet.ClusterRef
		wantCode codes.Code
		wantMsg  string
	}{
		{
			name:     "no agent for cluster",
			cluster:  fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: "fleet", Name: "b"}, UID: "uid-b"},
			wantCode: codes.Unavailable,
			wantMsg:  "no agent is connected for cluster fleet/b: unavailable",
		},
		{
			name:     "recreated cluster is not served by the old agent",
			cluster:  fleet.ClusterRef{NamespacedName: clusterA.NamespacedName, UID: "uid-a2"},
			wantCode: codes.Unavailable,
			wantMsg:  "no agent is connected for cluster fleet/a: unavailable",
		},
		{
			name: "agent refuses",
			minter: func(context.Context, *pb.MintRequest) (*pb.MintResponse, error) {
				return nil, fmt.Errorf("spoke ServiceAccount x/y does not allow u: %w", errdefs.ErrPermissionDenied)
			},
			cluster:  clusterA,
			wantCode: codes.PermissionDenied,
			wantMsg:  "cluster fleet/a: agent: spoke ServiceAccount x/y does not allow u: permission denied",
		},
		{
			name: "agent message with line breaks, escapes and a link",
			minter: func(context.Context, *pb.MintRequest) (*pb.MintResponse, error) {
				return nil, fmt.Errorf("no\nFAKE: log in at https://evil.example/x \x1b[31mnow: %w", errdefs.ErrPermissionDenied)
			},
			cluster:  clusterA,
			wantCode: codes.PermissionDenied,
			wantMsg:  "cluster fleet/a: agent: no FAKE: log in at [link removed] [31mnow: permission denied",
		},
		{
			name: "agent answers with a code that is not its to give",
			minter: func(context.Context, *pb.MintRequest) (*pb.MintResponse, error) {
				return nil, fmt.Errorf("odd: %w", errdefs.ErrUnauthenticated)
			},
			cluster:  clusterA,
			wantCode: codes.Unavailable,
			wantMsg:  "cluster fleet/a: agent: odd: unauthenticated",
		},
		{
			name: "agent fails internally",
			minter: func(context.Context, *pb.MintRequest) (*pb.MintResponse, error) {
				return nil, errors.New("secret internal detail")
			},
			cluster:  clusterA,
			wantCode: codes.Internal,
			wantMsg:  "cluster fleet/a: agent: " + errdefs.InternalMessage,
		},
		{
			name: "agent does not answer in time",
			minter: func(ctx context.Context, _ *pb.MintRequest) (*pb.MintResponse, error) {
				<-ctx.Done()
				return nil, ctx.Err()
			},
			cluster:  clusterA,
			wantCode: codes.DeadlineExceeded,
			wantMsg:  "cluster fleet/a: the agent did not answer in time: deadline exceeded",
		},
		{
			name: "agent answers with garbage",
			minter: func(context.Context, *pb.MintRequest) (*pb.MintResponse, error) {
				return &pb.MintResponse{Token: "not a jwt", ExpirationTime: timestamppb.Now()}, nil
			},
			cluster:  clusterA,
			wantCode: codes.Unavailable,
			wantMsg:  "cluster fleet/a: the agent answered with a malformed token: bearer token is not a JWT: 1 segments, want 3: unavailable",
		},
		{
			name: "agent answers without a token",
			minter: func(context.Context, *pb.MintRequest) (*pb.MintResponse, error) {
				return &pb.MintResponse{ExpirationTime: timestamppb.Now()}, nil
			},
			cluster:  clusterA,
			wantCode: codes.Unavailable,
			wantMsg:  "cluster fleet/a: the agent answered without a token or an expiry: unavailable",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t, 300*time.Millisecond)
			h.agent(t, agentA, &fakeMinter{fn: tt.minter})
			waitConnected(t, h, clusterA, 1)
			_, err := h.srv.Mint(context.Background(), tt.cluster, &pb.MintRequest{})
			require.Error(t, err)
			assert.Equal(t, tt.wantCode, errdefs.Code(err))
			assert.EqualError(t, err, tt.wantMsg)
		})
	}
}

func TestUnknownAgentIsRefused(t *testing.T) {
	h := newHarness(t, time.Second)
	log := &lineLog{}
	c, _ := h.agent(t, "spiffe://test.example/clusterprofile/fleet/unknown", &fakeMinter{}, func(cfg *ClientConfig) {
		cfg.Log = funcr.New(log.add, funcr.Options{})
	})

	// The refusal is a status on the stream; the client keeps retrying and
	// never counts as connected.
	stream := h.rawStream(t, "spiffe://test.example/clusterprofile/fleet/unknown")
	_ = stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_Hello{Hello: &pb.Hello{}}}) // io.EOF once refused
	_, err := stream.Recv()
	assert.Equal(t, codes.PermissionDenied, statusCode(err))
	assert.Contains(t, err.Error(), "no ClusterProfile accepts agent spiffe://test.example/clusterprofile/fleet/unknown")

	// The client has been refused, and has retried, before it is asked
	// whether it is connected: checked at once, it would not be yet
	// whatever the broker did.
	require.Eventually(t, func() bool { return log.count("broker stream ended; reconnecting") >= 2 },
		10*time.Second, 5*time.Millisecond)
	assert.Contains(t, log.String(), "no ClusterProfile accepts agent")
	select {
	case <-c.Connected():
		t.Fatal("an unknown agent was admitted")
	default:
	}
}

func TestAgentLeavesStreamAdmittedForAnotherCluster(t *testing.T) {
	h := newHarness(t, time.Second)
	log := &lineLog{}
	m := &fakeMinter{}
	c, _ := h.agent(t, agentA, m, func(cfg *ClientConfig) {
		cfg.Cluster = "fleet/b"
		cfg.Log = funcr.New(log.add, funcr.Options{})
	})

	// The broker admits agentA for fleet/a; the agent expects fleet/b, so it
	// closes every stream it is given and retries.
	require.Eventually(t, func() bool { return log.count("broker admitted the agent for another ClusterProfile") >= 2 },
		10*time.Second, 5*time.Millisecond)
	assert.Contains(t, log.String(), `"admittedFor"="fleet/a" "expected"="fleet/b"`)
	select {
	case <-c.Connected():
		t.Fatal("the agent counted a stream for another cluster as connected")
	default:
	}
	_, err := h.srv.Mint(context.Background(), clusterA, &pb.MintRequest{})
	if err == nil {
		t.Fatal("a mint reached an agent that does not serve the cluster")
	}
	assert.Zero(t, m.calls.Load())
}

// lineLog collects log lines for funcr.
type lineLog struct {
	mu    sync.Mutex
	lines []string
}

func (l *lineLog) add(prefix, args string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, prefix+" "+args)
}

func (l *lineLog) count(substr string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, line := range l.lines {
		if strings.Contains(line, substr) {
			n++
		}
	}
	return n
}

func (l *lineLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.lines, "\n")
}

func TestFirstFrameMustBeHello(t *testing.T) {
	h := newHarness(t, time.Second)
	stream := h.rawStream(t, agentA)
	require.NoError(t, stream.Send(&pb.AgentFrame{CorrelationId: "x", Body: &pb.AgentFrame_Error{Error: &pb.Error{}}}))
	_, err := stream.Recv()
	assert.Equal(t, codes.InvalidArgument, statusCode(err))
	assert.Equal(t, 0, h.srv.Connected(clusterA))
}

func TestRevalidateClosesStreamsOfChangedCluster(t *testing.T) {
	h := newHarness(t, time.Second)
	h.agent(t, agentA, &fakeMinter{})
	waitConnected(t, h, clusterA, 1)

	// The ClusterProfile is deleted: the stream closes and the agent is not
	// admitted again.
	h.resolver.set(agentA, nil)
	h.srv.Revalidate(clusterA.NamespacedName)
	waitConnected(t, h, clusterA, 0)

	// Recreated under the same name with a new UID: the agent's reconnect is
	// admitted for the new incarnation only.
	recreated := fleet.ClusterRef{NamespacedName: clusterA.NamespacedName, UID: "uid-a2"}
	h.resolver.set(agentA, &recreated)
	waitConnected(t, h, recreated, 1)
	assert.Equal(t, 0, h.srv.Connected(clusterA))
}

func TestStoppedAgentIsForgotten(t *testing.T) {
	h := newHarness(t, time.Second)
	_, stop := h.agent(t, agentA, &fakeMinter{})
	waitConnected(t, h, clusterA, 1)
	stop()
	waitConnected(t, h, clusterA, 0)
	_, err := h.srv.Mint(context.Background(), clusterA, &pb.MintRequest{})
	assert.ErrorIs(t, err, errdefs.ErrUnavailable)
}

func statusCode(err error) codes.Code { return status.Code(err) }

func TestMintMovesToAnotherStreamWhenOneCloses(t *testing.T) {
	h := newHarness(t, 5*time.Second)
	var stopDying func()
	dying := &fakeMinter{fn: func(ctx context.Context, _ *pb.MintRequest) (*pb.MintResponse, error) {
		go stopDying() // the stream closes while this request is on it
		<-ctx.Done()
		return nil, ctx.Err()
	}}
	healthy := &fakeMinter{}
	_, stopDying = h.agent(t, agentA, dying, leaveAtOnce)
	h.agent(t, agentA, healthy)
	waitConnected(t, h, clusterA, 2)

	// Mints of many namespaces: the first that picks the dying stream moves
	// to the healthy one. (Each namespace picks either stream with even
	// odds, so one of 20 misses the dying stream with odds of 2^-20.)
	const mints = 20
	for i := range mints {
		resp, err := h.srv.Mint(context.Background(), clusterA, mintIn(fmt.Sprintf("ns-%d", i)))
		require.NoError(t, err)
		assert.Equal(t, testToken, resp.GetToken())
	}
	assert.Equal(t, int32(1), dying.calls.Load())
	assert.Equal(t, int32(mints), healthy.calls.Load())
}

func TestStreamsPerClusterAreBounded(t *testing.T) {
	h := newHarness(t, time.Second) // at most 2 streams per cluster
	h.agent(t, agentA, &fakeMinter{})
	h.agent(t, agentA, &fakeMinter{})
	waitConnected(t, h, clusterA, 2)

	stream := h.rawStream(t, agentA)
	require.NoError(t, stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_Hello{Hello: &pb.Hello{}}}))
	_, err := stream.Recv()
	assert.Equal(t, codes.ResourceExhausted, statusCode(err))
	assert.Contains(t, err.Error(), "cluster fleet/a already has 2 agent streams to this broker")
	assert.Equal(t, 2, h.srv.Connected(clusterA))
}

func TestStreamEndsWithTheAgentsSVID(t *testing.T) {
	clk := testingclock.NewFakeClock(time.Now())
	h := newHarness(t, time.Second, func(cfg *ServerConfig) { cfg.Clock = clk })
	h.peers.setSVID(agentA, 30*time.Second)
	log := &lineLog{}
	h.agent(t, agentA, &fakeMinter{}, func(cfg *ClientConfig) { cfg.Log = funcr.New(log.add, funcr.Options{}) })
	waitConnected(t, h, clusterA, 1)

	// The SVID expires: the stream closes, and a new stream presenting the
	// same SVID is refused.
	clk.Step(30 * time.Second)
	waitConnected(t, h, clusterA, 0)
	require.Eventually(t, func() bool { return log.count("does not verify against the current trust bundle") > 0 },
		10*time.Second, 5*time.Millisecond)
	assert.Contains(t, log.String(), "its SVID expired at")
	_, err := h.srv.Mint(context.Background(), clusterA, &pb.MintRequest{})
	assert.Equal(t, codes.Unavailable, errdefs.Code(err), "a mint reached an agent whose SVID expired")

	// The agent's next stream presents the SVID its source holds then.
	h.peers.setSVID(agentA, time.Hour)
	waitConnected(t, h, clusterA, 1)
}

// Attack: an agent that opens streams and never says hello holds the
// broker's resources.
// Defence: the broker waits HelloTimeout for the hello, on its own clock.
func TestHelloTimeoutRunsOnTheServersClock(t *testing.T) {
	clk := testingclock.NewFakeClock(time.Now())
	h := newHarness(t, time.Second, func(cfg *ServerConfig) { cfg.Clock, cfg.HelloTimeout = clk, 5*time.Second })
	stream := h.rawStream(t, agentA)
	require.Eventually(t, clk.HasWaiters, 10*time.Second, 5*time.Millisecond, "the broker waits for the hello on its clock")

	clk.Step(5 * time.Second)
	_, err := stream.Recv()
	assert.Equal(t, codes.DeadlineExceeded, statusCode(err))
	assert.Contains(t, err.Error(), "agent stream: no hello within 5s")
	assert.Equal(t, 0, h.srv.Connected(clusterA))
}

func TestReverifyClosesStreamsTheBundleNoLongerTrusts(t *testing.T) {
	h := newHarness(t, time.Second)
	h.agent(t, agentA, &fakeMinter{})
	waitConnected(t, h, clusterA, 1)

	h.srv.Reverify()
	assert.Equal(t, 1, h.srv.Connected(clusterA), "a stream the bundle still trusts was closed")

	// The trust domain moves to a new CA; the agent's SVID is from the old one.
	next, err := testpki.NewCA("test.example")
	require.NoError(t, err)
	h.bundles.Add(x509bundle.FromX509Authorities(next.TrustDomain(), []*x509.Certificate{next.Certificate()}))
	h.srv.Reverify()
	assert.Equal(t, 0, h.srv.Connected(clusterA))
	_, err = h.srv.Mint(context.Background(), clusterA, &pb.MintRequest{})
	assert.Equal(t, codes.Unavailable, errdefs.Code(err))
}

func TestAgentWithoutCertificateIsRefused(t *testing.T) {
	h := newHarness(t, time.Second, func(cfg *ServerConfig) {
		cfg.Peer = func(context.Context) (spiffeid.ID, []*x509.Certificate, error) {
			return spiffeid.RequireFromString(agentA), nil, nil
		}
	})
	stream := h.rawStream(t, agentA)
	_ = stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_Hello{Hello: &pb.Hello{}}})
	_, err := stream.Recv()
	assert.Equal(t, codes.Unauthenticated, statusCode(err))
	assert.Contains(t, err.Error(), "presented no certificate")
}

func TestBundleChangeDuringHelloIsNotMissed(t *testing.T) {
	h := newHarness(t, time.Second)
	stream := h.rawStream(t, agentA)
	// The stream is open and verified, but not yet a session: Reverify
	// cannot see it while the broker awaits the hello.
	require.Eventually(t, func() bool { h.peers.mu.Lock(); defer h.peers.mu.Unlock(); return h.peers.chains[agentA] != nil },
		10*time.Second, 5*time.Millisecond)
	next, err := testpki.NewCA("test.example")
	require.NoError(t, err)
	h.bundles.Add(x509bundle.FromX509Authorities(next.TrustDomain(), []*x509.Certificate{next.Certificate()}))
	h.srv.Reverify()

	require.NoError(t, stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_Hello{Hello: &pb.Hello{}}}))
	closed := make(chan error, 1)
	go func() {
		_, err := stream.Recv()
		closed <- err
	}()
	select {
	case err := <-closed:
		assert.Equal(t, codes.Unauthenticated, statusCode(err))
		assert.Contains(t, err.Error(), "does not verify against the current trust bundle")
	case <-time.After(10 * time.Second):
		t.Fatal("a stream that the new bundle does not trust was admitted")
	}
	assert.Equal(t, 0, h.srv.Connected(clusterA))
}

// The agent logs how many grants it reported, in its hello and the
// updates after it together.
func TestAgentLogsTheGrantsItReported(t *testing.T) {
	h := newHarness(t, time.Second)
	log := &lineLog{}
	c, _ := h.agent(t, agentA, &fakeMinter{}, func(cfg *ClientConfig) {
		cfg.Log = funcr.New(log.add, funcr.Options{})
		cfg.Grants = &fakeAgentGrants{snapshots: [][]*pb.Grant{grantsNamed("g", grantChunk+1)}}
	})
	// The agent counts itself connected after it logs the line; the
	// broker counts the stream before.
	select {
	case <-c.Connected():
	case <-time.After(10 * time.Second):
		t.Fatal("the agent did not connect")
	}
	assert.Contains(t, log.String(), fmt.Sprintf(`"msg"="connected to broker" "broker"="passthrough:///bufnet" "cluster"="fleet/a" "grants"=%d`, grantChunk+1))
}

// The broker audits the end of an agent's stream with the status it ended
// on: an agent that closes its stream ends it cleanly (OK), one that goes
// away without closing it does not.
func TestAgentStreamEndIsAudited(t *testing.T) {
	tests := []struct {
		name string
		end  func(stream grpc.BidiStreamingClient[pb.AgentFrame, pb.BrokerFrame], cancel context.CancelFunc)
		want string
	}{
		{
			name: "closed",
			end: func(stream grpc.BidiStreamingClient[pb.AgentFrame, pb.BrokerFrame], _ context.CancelFunc) {
				assert.NoError(t, stream.CloseSend())
			},
			want: `"code"="OK"`,
		},
		{
			name: "gone",
			end:  func(_ grpc.BidiStreamingClient[pb.AgentFrame, pb.BrokerFrame], cancel context.CancelFunc) { cancel() },
			want: `"code"="Canceled" "reason"=`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			audit := &lineLog{}
			h := newHarness(t, time.Second, func(cfg *ServerConfig) { cfg.Audit = funcr.New(audit.add, funcr.Options{}) })
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			stream := h.rawStreamContext(t, ctx, agentA)
			require.NoError(t, stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_Hello{Hello: &pb.Hello{}}}))
			waitConnected(t, h, clusterA, 1)

			tt.end(stream, cancel)
			waitConnected(t, h, clusterA, 0)
			require.Eventually(t, func() bool { return audit.count("agent disconnected") == 1 }, 10*time.Second, 5*time.Millisecond)
			var end string
			for _, line := range strings.Split(audit.String(), "\n") {
				if strings.Contains(line, `"msg"="agent disconnected"`) {
					end = line
				}
			}
			assert.Contains(t, end, tt.want)
		})
	}
}
