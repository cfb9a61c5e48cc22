package tunnel

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/apimachinery/pkg/types"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// fakeRegistry records what the Server reports to the broker's registry.
type fakeRegistry struct {
	mu       sync.Mutex
	replaced [][]*pb.Grant      // the grants of each Hello
	clusters []fleet.ClusterRef // the cluster of each Hello and Update
	updates  []*pb.GrantUpdate
	state    []string // the credential ids the registry holds
	// block, when set, holds up the first Hello until it is closed;
	// blocked is closed when that Hello starts waiting.
	block, blocked chan struct{}
	// refuse, when set, is what Hello and Report answer a report that
	// holds the credential id JTI=refused.
	refuse error
}

func (r *fakeRegistry) refused(grants []*pb.Grant) error {
	if slices.Contains(grantIDs(grants), "JTI=refused") {
		return r.refuse
	}
	return nil
}

func (r *fakeRegistry) Hello(_ context.Context, cluster fleet.ClusterRef, grants []*pb.Grant) error {
	r.mu.Lock()
	block := r.block
	r.block = nil
	if err := r.refused(grants); err != nil {
		r.mu.Unlock()
		return err
	}
	r.replaced = append(r.replaced, grants)
	r.clusters = append(r.clusters, cluster)
	// As grants.Registry does, a hello adds and never removes.
	for _, id := range grantIDs(grants) {
		if !slices.Contains(r.state, id) {
			r.state = append(r.state, id)
		}
	}
	r.mu.Unlock()
	if block != nil {
		close(r.blocked)
		<-block
	}
	return nil
}

func (r *fakeRegistry) Report(_ context.Context, cluster fleet.ClusterRef, u *pb.GrantUpdate) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.refused(u.GetAdded()); err != nil {
		return err
	}
	r.updates = append(r.updates, u)
	r.clusters = append(r.clusters, cluster)
	r.state = slices.DeleteFunc(r.state, func(id string) bool { return slices.Contains(u.GetRemoved(), id) })
	r.state = append(r.state, grantIDs(u.GetAdded())...)
	return nil
}

// known returns the credential ids the registry holds: those of the
// hellos and updates, less those removed since.
func (r *fakeRegistry) known() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.state)
}

func (r *fakeRegistry) replaces() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.replaced)
}

func grantIDs(gs []*pb.Grant) []string {
	ids := make([]string, len(gs))
	for i, g := range gs {
		ids[i] = g.GetCredentialId()
	}
	return ids
}

func grant(id string) *pb.Grant {
	return &pb.Grant{
		CredentialId:   id,
		Cluster:        &pb.ObjectReference{Namespace: "fleet", Name: "a"},
		Subject:        &pb.Subject{Username: "system:serviceaccount:hub:c", Uid: "u", Groups: []string{"system:serviceaccounts"}},
		ServiceAccount: &pb.ObjectReference{Namespace: "spoke", Name: "reader"},
		ExpirationTime: timestamppb.New(time.Unix(2e9, 0)),
	}
}

func grantsNamed(prefix string, n int) []*pb.Grant {
	out := make([]*pb.Grant, n)
	for i := range out {
		out[i] = grant(fmt.Sprintf("JTI=%s-%d", prefix, i))
	}
	return out
}

// fakeAgentGrants is the agent's side: snapshots, subscribers, revokes.
type fakeAgentGrants struct {
	mu        sync.Mutex
	snapshots [][]*pb.Grant // one per Snapshot call; the last repeats
	snapped   int
	removed   []string
	subs      map[int]func(*pb.GrantUpdate)
	nextSub   int
	revoke    func(ctx context.Context, req *pb.RevokeRequest) (*pb.RevokeResponse, error)
	revokes   []*pb.RevokeRequest
	admitted  []fleet.ClusterRef // the cluster of each Revoke
}

func (g *fakeAgentGrants) Snapshot() []*pb.Grant {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.snapped++
	if len(g.snapshots) == 0 {
		return nil
	}
	return g.snapshots[min(g.snapped, len(g.snapshots))-1]
}

func (g *fakeAgentGrants) Removed() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.removed)
}

func (g *fakeAgentGrants) Subscribe(fn func(*pb.GrantUpdate)) func() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.subs == nil {
		g.subs = map[int]func(*pb.GrantUpdate){}
	}
	id := g.nextSub
	g.nextSub++
	g.subs[id] = fn
	return func() {
		g.mu.Lock()
		defer g.mu.Unlock()
		delete(g.subs, id)
	}
}

// publish sends u to every subscriber, as a grant informer would.
func (g *fakeAgentGrants) publish(u *pb.GrantUpdate) {
	for _, fn := range g.subscribers() {
		fn(u)
	}
}

func (g *fakeAgentGrants) subscribers() []func(*pb.GrantUpdate) {
	g.mu.Lock()
	defer g.mu.Unlock()
	var fns []func(*pb.GrantUpdate)
	for _, fn := range g.subs {
		fns = append(fns, fn)
	}
	return fns
}

func (g *fakeAgentGrants) Revoke(ctx context.Context, cluster fleet.ClusterRef, req *pb.RevokeRequest) (*pb.RevokeResponse, error) {
	g.mu.Lock()
	g.revokes = append(g.revokes, req)
	g.admitted = append(g.admitted, cluster)
	fn := g.revoke
	g.mu.Unlock()
	if fn != nil {
		return fn(ctx, req)
	}
	return &pb.RevokeResponse{CredentialIds: req.GetCredentialIds()}, nil
}

func withRegistry(r *fakeRegistry) func(*ServerConfig) { return func(c *ServerConfig) { c.Grants = r } }

func withAgentGrants(g Grants) func(*ClientConfig) { return func(c *ClientConfig) { c.Grants = g } }

func TestHelloGrantsAndUpdatesReachTheRegistry(t *testing.T) {
	tests := []struct {
		name     string
		snapshot []*pb.Grant
	}{
		{name: "no grants"},
		{name: "a few", snapshot: grantsNamed("a", 3)},
		// More than one frame holds: the rest follow the hello as updates.
		{name: "more than a frame holds", snapshot: grantsNamed("big", 3*grantChunk+7)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reg := &fakeRegistry{}
			h := newHarness(t, time.Second, withRegistry(reg))
			ag := &fakeAgentGrants{snapshots: [][]*pb.Grant{tt.snapshot}}
			h.agent(t, agentA, &fakeMinter{}, withAgentGrants(ag))
			waitConnected(t, h, clusterA, 1)
			want := grantIDs(tt.snapshot)
			require.Eventually(t, func() bool { return slices.Equal(want, reg.known()) }, 10*time.Second, 5*time.Millisecond)

			ag.publish(&pb.GrantUpdate{Added: []*pb.Grant{grant("JTI=new")}})
			want = append(want, "JTI=new")
			require.Eventually(t, func() bool { return slices.Equal(want, reg.known()) }, 10*time.Second, 5*time.Millisecond)
			if len(want) > 1 {
				ag.publish(&pb.GrantUpdate{Removed: []string{want[0]}})
				want = want[1:]
				require.Eventually(t, func() bool { return slices.Equal(want, reg.known()) }, 10*time.Second, 5*time.Millisecond)
			}

			reg.mu.Lock()
			defer reg.mu.Unlock()
			require.Len(t, reg.replaced, 1)
			assert.LessOrEqual(t, len(reg.replaced[0]), grantChunk)
			for _, c := range reg.clusters {
				assert.Equal(t, clusterA, c, "the registry must learn the cluster the broker admitted the stream for")
			}
			if len(tt.snapshot) > 0 {
				assert.True(t, proto.Equal(tt.snapshot[0], reg.replaced[0][0]))
			}
		})
	}
}

func TestAgentWithoutGrants(t *testing.T) {
	reg := &fakeRegistry{}
	h := newHarness(t, time.Second, withRegistry(reg))
	h.agent(t, agentA, &fakeMinter{})
	waitConnected(t, h, clusterA, 1)
	require.Eventually(t, func() bool { return reg.replaces() == 1 }, 10*time.Second, 5*time.Millisecond)
	assert.Empty(t, reg.known())

	_, err := h.srv.Revoke(context.Background(), clusterA, []string{"JTI=x"}, "test")
	assert.Equal(t, codes.FailedPrecondition, errdefs.Code(err))
	assert.EqualError(t, err, "cluster fleet/a: agent: this agent keeps no grants: failed precondition")
}

func TestRevoke(t *testing.T) {
	tests := []struct {
		name     string
		ids      []string
		revoke   func(ctx context.Context, req *pb.RevokeRequest) (*pb.RevokeResponse, error)
		cluster  fleet.ClusterRef
		want     []string
		wantCode codes.Code
		wantMsg  string
		ignored  int // ids of the agent's answer that were not asked, logged
	}{
		{
			name: "every id gone", ids: []string{"JTI=a", "JTI=b"},
			cluster: clusterA, want: []string{"JTI=a", "JTI=b"},
		},
		{
			name: "some ids gone", ids: []string{"JTI=a", "JTI=b"},
			revoke: func(context.Context, *pb.RevokeRequest) (*pb.RevokeResponse, error) {
				return &pb.RevokeResponse{CredentialIds: []string{"JTI=b"}}, nil
			},
			cluster: clusterA, want: []string{"JTI=b"},
		},
		{
			// The attack: a compromised agent reports grants gone that it was
			// not asked about, or one twice, so that the broker's registry
			// counts them revoked while they live on another spoke.
			name: "ids the agent was not asked about are ignored", ids: []string{"JTI=a"},
			revoke: func(context.Context, *pb.RevokeRequest) (*pb.RevokeResponse, error) {
				return &pb.RevokeResponse{CredentialIds: []string{"JTI=a", "JTI=other", "JTI=a", ""}}, nil
			},
			cluster: clusterA, want: []string{"JTI=a"}, ignored: 3,
		},
		{
			name: "no ids", cluster: clusterA,
		},
		{
			name: "no agent for cluster", ids: []string{"JTI=a"},
			cluster:  fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: "fleet", Name: "b"}, UID: "uid-b"},
			wantCode: codes.Unavailable,
			wantMsg:  "no agent is connected for cluster fleet/b: unavailable",
		},
		{
			name: "recreated cluster is not served by the old agent", ids: []string{"JTI=a"},
			cluster:  fleet.ClusterRef{NamespacedName: clusterA.NamespacedName, UID: "uid-a2"},
			wantCode: codes.Unavailable,
			wantMsg:  "no agent is connected for cluster fleet/a: unavailable",
		},
		{
			name: "agent refuses", ids: []string{"JTI=a"},
			revoke: func(context.Context, *pb.RevokeRequest) (*pb.RevokeResponse, error) {
				return nil, fmt.Errorf("grant x is not of this cluster: %w", errdefs.ErrPermissionDenied)
			},
			cluster:  clusterA,
			wantCode: codes.PermissionDenied,
			wantMsg:  "cluster fleet/a: agent: grant x is not of this cluster: permission denied",
		},
		{
			name: "agent answers with a code that is not its to give", ids: []string{"JTI=a"},
			revoke: func(context.Context, *pb.RevokeRequest) (*pb.RevokeResponse, error) {
				return nil, fmt.Errorf("odd\nhttps://evil.example: %w", errdefs.ErrUnauthenticated)
			},
			cluster:  clusterA,
			wantCode: codes.Unavailable,
			wantMsg:  "cluster fleet/a: agent: odd [link removed] unauthenticated",
		},
		{
			name: "agent does not answer in time", ids: []string{"JTI=a"},
			revoke: func(ctx context.Context, _ *pb.RevokeRequest) (*pb.RevokeResponse, error) {
				<-ctx.Done()
				return nil, ctx.Err()
			},
			cluster:  clusterA,
			wantCode: codes.DeadlineExceeded,
			wantMsg:  "cluster fleet/a: the agent did not answer in time: deadline exceeded",
		},
		{
			name: "agent answers with nothing", ids: []string{"JTI=a"},
			revoke: func(context.Context, *pb.RevokeRequest) (*pb.RevokeResponse, error) {
				return nil, nil
			},
			cluster:  clusterA,
			wantCode: codes.Internal,
			wantMsg:  "cluster fleet/a: agent: " + errdefs.InternalMessage,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			log := &lineLog{}
			h := newHarness(t, 300*time.Millisecond, func(cfg *ServerConfig) { cfg.Log = funcr.New(log.add, funcr.Options{}) })
			ag := &fakeAgentGrants{revoke: tt.revoke}
			h.agent(t, agentA, &fakeMinter{}, withAgentGrants(ag))
			waitConnected(t, h, clusterA, 1)
			got, err := h.srv.Revoke(context.Background(), tt.cluster, tt.ids, "test reason")
			const ignoredLine = "agent answered a revoke with credential ids it was not asked about"
			if tt.ignored > 0 {
				assert.Contains(t, log.String(), fmt.Sprintf(`%s; ignored them" "cluster"="fleet/a" "ignored"=%d`, ignoredLine, tt.ignored))
			} else {
				assert.Zero(t, log.count(ignoredLine))
			}
			if tt.wantCode != codes.OK {
				require.Error(t, err)
				assert.Equal(t, tt.wantCode, errdefs.Code(err))
				assert.EqualError(t, err, tt.wantMsg)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
			ag.mu.Lock()
			defer ag.mu.Unlock()
			if len(tt.ids) == 0 {
				assert.Empty(t, ag.revokes, "a revoke of nothing reached the agent")
				return
			}
			require.Len(t, ag.revokes, 1)
			assert.Equal(t, tt.ids, ag.revokes[0].GetCredentialIds())
			assert.Equal(t, "test reason", ag.revokes[0].GetReason())
			assert.Equal(t, []fleet.ClusterRef{clusterA}, ag.admitted)
		})
	}
}

// An agent's answer repeats the ids; a long list goes in several requests
// so that no answer exceeds the broker's 64 KiB message limit.
func TestRevokeOfManyIDs(t *testing.T) {
	h := newHarness(t, 5*time.Second)
	ag := &fakeAgentGrants{}
	h.agent(t, agentA, &fakeMinter{}, withAgentGrants(ag))
	waitConnected(t, h, clusterA, 1)
	var ids []string
	for i := range 1000 {
		ids = append(ids, fmt.Sprintf("JTI=%08d-aaaa-bbbb-cccc-%012d", i, i))
	}
	ids = append(ids, ids[0], "") // a repeat and an empty one are not sent
	got, err := h.srv.Revoke(context.Background(), clusterA, ids, "many")
	require.NoError(t, err)
	assert.Equal(t, ids[:1000], got)
	ag.mu.Lock()
	defer ag.mu.Unlock()
	require.Greater(t, len(ag.revokes), 1)
	for _, req := range ag.revokes {
		assert.LessOrEqual(t, len(req.GetCredentialIds()), maxRevokeIDs)
	}
}

// A revoke goes to every agent instance; one whose stream closes under it,
// and that has no newer stream, did not answer, so the ids stay pending
// (not gone) and the caller sends them again: then to the instances left.
func TestRevokeStaysPendingWhenAnInstanceClosesUnderIt(t *testing.T) {
	h := newHarness(t, 5*time.Second)
	var stopDying func()
	dying := &fakeAgentGrants{revoke: func(ctx context.Context, _ *pb.RevokeRequest) (*pb.RevokeResponse, error) {
		go stopDying() // the stream closes while this request is on it
		<-ctx.Done()
		return nil, ctx.Err()
	}}
	healthy := &fakeAgentGrants{}
	_, stopDying = h.agent(t, agentA, &fakeMinter{}, withAgentGrants(dying), leaveAtOnce)
	h.agent(t, agentA, &fakeMinter{}, withAgentGrants(healthy))
	waitConnected(t, h, clusterA, 2)

	got, err := h.srv.Revoke(context.Background(), clusterA, []string{"JTI=a"}, "test")
	assert.Equal(t, codes.Unavailable, errdefs.Code(err), "%v", err)
	assert.Empty(t, got, "an id that an instance did not answer for was counted gone")
	waitConnected(t, h, clusterA, 1)
	got, err = h.srv.Revoke(context.Background(), clusterA, []string{"JTI=a"}, "test")
	require.NoError(t, err)
	assert.Equal(t, []string{"JTI=a"}, got)
	dying.mu.Lock()
	defer dying.mu.Unlock()
	healthy.mu.Lock()
	defer healthy.mu.Unlock()
	assert.Len(t, dying.revokes, 1)
	assert.Len(t, healthy.revokes, 2)
}

// Mints and revokes share the stream's in-flight limit: a revoke waits for
// a slot, and is answered once one frees.
func TestRevokeSharesInFlightLimitWithMints(t *testing.T) {
	h := newHarness(t, 5*time.Second)
	release := make(chan struct{})
	m := &fakeMinter{fn: func(ctx context.Context, _ *pb.MintRequest) (*pb.MintResponse, error) {
		<-release
		return &pb.MintResponse{Token: testToken, ExpirationTime: timestamppb.New(time.Unix(2e9, 0))}, nil
	}}
	ag := &fakeAgentGrants{}
	h.agent(t, agentA, m, withAgentGrants(ag), func(c *ClientConfig) { c.MaxInFlight = 1 })
	waitConnected(t, h, clusterA, 1)
	minted := make(chan error, 1)
	go func() {
		_, err := h.srv.Mint(context.Background(), clusterA, &pb.MintRequest{})
		minted <- err
	}()
	require.Eventually(t, func() bool { return m.calls.Load() == 1 }, 10*time.Second, 5*time.Millisecond)
	revoked := make(chan error, 1)
	go func() {
		_, err := h.srv.Revoke(context.Background(), clusterA, []string{"JTI=a"}, "test")
		revoked <- err
	}()
	select {
	case err := <-revoked:
		t.Fatalf("a revoke was handled beside a mint with MaxInFlight 1: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	require.NoError(t, <-minted)
	require.NoError(t, <-revoked)
}

// The attack: a compromised agent floods the broker's registry with grants
// in one frame. The broker refuses the frame and closes the stream.
func TestOversizedGrantFramesCloseTheStream(t *testing.T) {
	t.Run("hello", func(t *testing.T) {
		reg := &fakeRegistry{}
		h := newHarness(t, time.Second, withRegistry(reg))
		stream := h.rawStream(t, agentA)
		ids := make([]*pb.Grant, MaxGrantsPerFrame+1)
		for i := range ids {
			ids[i] = &pb.Grant{}
		}
		require.NoError(t, stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_Hello{Hello: &pb.Hello{Grants: ids}}}))
		err := recvErr(t, stream)
		assert.Equal(t, codes.InvalidArgument, statusCode(err))
		assert.Contains(t, err.Error(), "the hello carries 1025 grants, more than 1024")
		assert.Zero(t, reg.replaces())
		assert.Equal(t, 0, h.srv.Connected(clusterA))
	})
	t.Run("update", func(t *testing.T) {
		reg := &fakeRegistry{}
		h := newHarness(t, time.Second, withRegistry(reg))
		stream := h.rawStream(t, agentA)
		require.NoError(t, stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_Hello{Hello: &pb.Hello{}}}))
		waitConnected(t, h, clusterA, 1)
		removed := make([]string, MaxGrantsPerFrame+1)
		require.NoError(t, stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_GrantUpdate{GrantUpdate: &pb.GrantUpdate{Removed: removed}}}))
		err := recvErr(t, stream)
		assert.Equal(t, codes.InvalidArgument, statusCode(err))
		assert.Contains(t, err.Error(), "a grant update of 1025 grants, more than 1024")
		reg.mu.Lock()
		defer reg.mu.Unlock()
		assert.Empty(t, reg.updates)
	})
}

// recvErr returns the error that ends stream, within 10s.
func recvErr(t *testing.T, stream grpc.BidiStreamingClient[pb.AgentFrame, pb.BrokerFrame]) error {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		for {
			if _, err := stream.Recv(); err != nil {
				done <- err
				return
			}
		}
	}()
	select {
	case err := <-done:
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("the broker did not close the stream")
		return nil
	}
}

// A grant update that answers a request's correlation id is no update.
func TestGrantUpdateWithCorrelationIDIsNotApplied(t *testing.T) {
	reg := &fakeRegistry{}
	h := newHarness(t, time.Second, withRegistry(reg))
	stream := h.rawStream(t, agentA)
	require.NoError(t, stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_Hello{Hello: &pb.Hello{}}}))
	waitConnected(t, h, clusterA, 1)
	require.NoError(t, stream.Send(&pb.AgentFrame{CorrelationId: "x", Body: &pb.AgentFrame_GrantUpdate{GrantUpdate: &pb.GrantUpdate{Added: []*pb.Grant{grant("JTI=x")}}}}))
	require.NoError(t, stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_GrantUpdate{GrantUpdate: &pb.GrantUpdate{Added: []*pb.Grant{grant("JTI=y")}}}}))
	require.Eventually(t, func() bool { return slices.Equal([]string{"JTI=y"}, reg.known()) }, 10*time.Second, 5*time.Millisecond)
}

// A stream whose grant updates come faster than it sends them is closed;
// the next stream's hello carries a fresh snapshot, so nothing is lost.
func TestGrantQueueOverflowClosesTheStream(t *testing.T) {
	release := make(chan struct{})
	reg := &fakeRegistry{block: release, blocked: make(chan struct{})} // the broker reads nothing until released
	h := newHarness(t, time.Second, withRegistry(reg))
	ag := &fakeAgentGrants{snapshots: [][]*pb.Grant{{grant("JTI=old")}, {grant("JTI=fresh")}}}
	log := &lineLog{}
	c, _ := h.agent(t, agentA, &fakeMinter{}, withAgentGrants(ag), func(cfg *ClientConfig) {
		cfg.MaxQueuedGrantUpdates = 2
		cfg.Log = funcr.New(log.add, funcr.Options{})
	})
	<-c.Connected()
	<-reg.blocked
	// JTI=old's grant goes while the queue overflows: the next stream
	// tells its removal after the hello.
	ag.mu.Lock()
	ag.removed = []string{"JTI=old"}
	ag.mu.Unlock()

	// Updates of 20 KiB each: the broker's window holds a few, the queue two.
	big := grant("JTI=big")
	big.Audiences = []string{strings.Repeat("x", 20<<10)}
	subs := ag.subscribers() // the first stream's only
	require.Len(t, subs, 1)
	for range 100 {
		subs[0](&pb.GrantUpdate{Added: []*pb.Grant{big}})
	}
	require.Eventually(t, func() bool { return log.count("grant updates overflowed the stream's queue; closing the stream") >= 1 },
		10*time.Second, 5*time.Millisecond)
	waitConnected(t, h, clusterA, 0)
	close(release)

	// The first stream's queued updates may still reach the registry; what
	// matters is that the next stream's hello brings the fresh grant, and
	// the removal that followed it takes out the old one.
	require.Eventually(t, func() bool {
		known := reg.known()
		return reg.replaces() >= 2 && slices.Contains(known, "JTI=fresh") && !slices.Contains(known, "JTI=old")
	}, 10*time.Second, 5*time.Millisecond)
	waitConnected(t, h, clusterA, 1)
	assert.Contains(t, log.String(), "grant updates overflowed the stream's queue; the next stream's hello reports every grant")
}

// The removals the agent remembers follow the hello of every stream: a
// broker replica whose stream was down when a grant went learns of it.
func TestRemovalsFollowTheHello(t *testing.T) {
	reg := &fakeRegistry{}
	h := newHarness(t, time.Second, withRegistry(reg))
	reg.mu.Lock()
	reg.state = []string{"JTI=gone", "JTI=kept"} // from an earlier stream
	reg.mu.Unlock()
	ag := &fakeAgentGrants{snapshots: [][]*pb.Grant{{grant("JTI=kept")}}, removed: []string{"JTI=gone"}}
	h.agent(t, agentA, &fakeMinter{}, withAgentGrants(ag))
	require.Eventually(t, func() bool { return slices.Equal([]string{"JTI=kept"}, reg.known()) }, 10*time.Second, 5*time.Millisecond)
}

func TestSplitUpdate(t *testing.T) {
	huge := grant("JTI=huge")
	huge.Audiences = []string{strings.Repeat("x", grantChunkBytes)}
	many := grantsNamed("m", grantChunk+1)
	tests := []struct {
		name        string
		in          *pb.GrantUpdate
		wantFrames  int
		wantDropped int
	}{
		{name: "empty", in: &pb.GrantUpdate{}},
		{name: "one", in: &pb.GrantUpdate{Added: many[:1]}, wantFrames: 1},
		{name: "more than a frame's count", in: &pb.GrantUpdate{Added: many}, wantFrames: 2},
		{name: "removals and additions", in: &pb.GrantUpdate{Removed: []string{"JTI=r"}, Added: many[:grantChunk]}, wantFrames: 2},
		{name: "a grant too large", in: &pb.GrantUpdate{Added: []*pb.Grant{many[0], huge, many[1]}}, wantFrames: 1, wantDropped: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, dropped := splitUpdate(tt.in)
			assert.Len(t, out, tt.wantFrames)
			assert.Equal(t, tt.wantDropped, dropped)
			var removed, added []string
			for _, u := range out {
				assert.LessOrEqual(t, len(u.GetAdded())+len(u.GetRemoved()), grantChunk)
				assert.LessOrEqual(t, proto.Size(u), grantChunkBytes+64)
				if len(added) > 0 {
					assert.Empty(t, u.GetRemoved(), "removals come first, as the broker applies them")
				}
				removed = append(removed, u.GetRemoved()...)
				added = append(added, grantIDs(u.GetAdded())...)
			}
			assert.Equal(t, tt.in.GetRemoved(), removed)
			var wantAdded []string
			for _, id := range grantIDs(tt.in.GetAdded()) {
				if id != "JTI=huge" {
					wantAdded = append(wantAdded, id)
				}
			}
			assert.Equal(t, wantAdded, added)
		})
	}
}

// A hello or grant update that the registry refuses (it breaks a bound of
// what one agent may report) closes the stream with the registry's code,
// and the refusal is audited.
func TestRefusedGrantReportsCloseTheStream(t *testing.T) {
	for _, tc := range []struct {
		name  string
		hello []*pb.Grant
		then  *pb.GrantUpdate
		err   error
	}{
		{name: "hello", hello: []*pb.Grant{grant("JTI=refused")}, err: fmt.Errorf("too big: %w", errdefs.ErrInvalidArgument)},
		{name: "update", then: &pb.GrantUpdate{Added: []*pb.Grant{grant("JTI=refused")}}, err: fmt.Errorf("too many: %w", errdefs.ErrResourceExhausted)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reg := &fakeRegistry{refuse: tc.err}
			audit := &lineLog{}
			h := newHarness(t, time.Second, withRegistry(reg), func(c *ServerConfig) { c.Audit = funcr.New(audit.add, funcr.Options{}) })
			// A stream the broker keeps open ends with ctx instead.
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			stream := h.rawStreamContext(t, ctx, agentA)
			require.NoError(t, stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_Hello{Hello: &pb.Hello{Grants: tc.hello}}}))
			if tc.then != nil {
				waitConnected(t, h, clusterA, 1)
				require.NoError(t, stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_GrantUpdate{GrantUpdate: tc.then}}))
			}
			var err error
			for err == nil {
				_, err = stream.Recv()
			}
			assert.Equal(t, errdefs.Code(tc.err), statusCode(err), "%v", err)
			assert.Contains(t, err.Error(), tc.err.Error())
			waitConnected(t, h, clusterA, 0)
			assert.NotContains(t, reg.known(), "JTI=refused")
			want := `"agent disconnected"`
			if tc.hello != nil {
				want = `"agent refused"`
			}
			require.Eventually(t, func() bool { return audit.count(want) == 1 }, 10*time.Second, 5*time.Millisecond, "%s", audit)
			assert.Contains(t, audit.String(), `"code"="`+errdefs.Code(tc.err).String()+`"`)
		})
	}
}

// What an agent names itself, and its stray correlation ids, reach the
// log clipped, and fit to print.
func TestAgentStringsAreClippedForLogs(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"v1.2.3", "v1.2.3"},
		{strings.Repeat("v", maxAgentVersion), strings.Repeat("v", maxAgentVersion)},
		{strings.Repeat("v", maxAgentVersion+1), strings.Repeat("v", maxAgentVersion) + "..."},
		{strings.Repeat("v", 1<<20), strings.Repeat("v", maxAgentVersion) + "..."},
		{"v1\n\x1b[31mred", "v1 [31mred"},
		{strings.Repeat("v", maxAgentVersion-1) + "é", strings.Repeat("v", maxAgentVersion-1) + "..."},
	} {
		got := agentVersion(tc.in)
		assert.Equal(t, tc.want, got)
		assert.LessOrEqual(t, len(got), maxAgentVersion+len("..."))
	}
	assert.Equal(t, strings.Repeat("c", maxLoggedCorrelationID)+"...", clipAgentString(strings.Repeat("c", 10_000), maxLoggedCorrelationID))
}
