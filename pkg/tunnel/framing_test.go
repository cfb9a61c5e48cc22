package tunnel

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/apimachinery/pkg/types"

	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/grants"
	"github.com/credbroker/credbroker/pkg/grants/selector"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// sizedGrants returns n grants whose grantSize is size each.
func sizedGrants(t *testing.T, prefix string, n, size int) []*pb.Grant {
	t.Helper()
	out := make([]*pb.Grant, n)
	for i := range out {
		id := fmt.Sprintf("JTI=%s-%d-", prefix, i)
		g := &pb.Grant{}
		for pad := size; pad >= 0; pad-- {
			g.CredentialId = id + strings.Repeat("x", pad)
			if grantSize(g) == size {
				break
			}
		}
		require.Equal(t, size, grantSize(g), "no grant of size %d", size)
		out[i] = g
	}
	return out
}

// A hello carries as many grants as fit in grantChunkBytes with the rest of
// the hello, and no more than grantChunk; the others follow as updates.
func TestHelloFillsItsBudgetExactly(t *testing.T) {
	exact := grantChunkBytes / 256 // grants of 256 bytes that fill a frame
	tests := []struct {
		name      string
		hello     *pb.Hello
		grants    []*pb.Grant
		wantHello int
	}{
		{name: "grants that fill the budget exactly", hello: &pb.Hello{}, grants: sizedGrants(t, "a", exact, 256), wantHello: exact},
		{name: "one grant more", hello: &pb.Hello{}, grants: sizedGrants(t, "b", exact+1, 256), wantHello: exact},
		{
			name:      "the hello's own fields count",
			hello:     &pb.Hello{Server: "https://spoke.example:6443", AgentVersion: "v1"},
			grants:    sizedGrants(t, "c", exact, 256),
			wantHello: exact - 1,
		},
		{name: "more grants than a frame holds", hello: &pb.Hello{}, grants: grantsNamed("d", grantChunk+1), wantHello: grantChunk},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := NewClient(ClientConfig{
				Address: "broker:443", Credentials: insecure.NewCredentials(), Minter: &fakeMinter{},
				Hello: tt.hello, Grants: &fakeAgentGrants{snapshots: [][]*pb.Grant{tt.grants}},
			})
			require.NoError(t, err)
			hello, rest := c.hello(logr.Discard())
			assert.Len(t, hello.GetGrants(), tt.wantHello)
			assert.LessOrEqual(t, proto.Size(hello), grantChunkBytes+64)
			sent := grantIDs(hello.GetGrants())
			for _, u := range rest {
				sent = append(sent, grantIDs(u.GetAdded())...)
			}
			assert.Equal(t, grantIDs(tt.grants), sent, "every grant is reported once, in order")
			assert.Empty(t, tt.hello.GetGrants(), "the configured hello is not modified")
		})
	}
}

// A grant update frame holds grants up to grantChunkBytes exactly, and up
// to grantChunk of them; a single grant of exactly grantChunkBytes is sent,
// one byte more is dropped.
func TestSplitUpdateBoundsAreExact(t *testing.T) {
	exact := grantChunkBytes / 256
	tests := []struct {
		name        string
		in          *pb.GrantUpdate
		wantFrames  []int // grants and ids per frame
		wantDropped int
	}{
		{name: "a frame filled exactly", in: &pb.GrantUpdate{Added: sizedGrants(t, "a", exact, 256)}, wantFrames: []int{exact}},
		{name: "one byte over", in: &pb.GrantUpdate{Added: append(sizedGrants(t, "b", exact-1, 256), sizedGrants(t, "c", 1, 257)...)}, wantFrames: []int{exact - 1, 1}},
		{name: "as many grants as a frame holds", in: &pb.GrantUpdate{Added: grantsNamed("d", grantChunk)}, wantFrames: []int{grantChunk}},
		{name: "a grant of a whole frame", in: &pb.GrantUpdate{Added: sizedGrants(t, "e", 1, grantChunkBytes)}, wantFrames: []int{1}},
		{name: "a grant over a whole frame", in: &pb.GrantUpdate{Added: sizedGrants(t, "f", 1, grantChunkBytes+1)}, wantDropped: 1},
		{
			name:       "removals count by their size",
			in:         &pb.GrantUpdate{Removed: []string{strings.Repeat("r", 252)}, Added: sizedGrants(t, "g", exact-1, 256)},
			wantFrames: []int{exact},
		},
		{
			name:       "a removal one byte over",
			in:         &pb.GrantUpdate{Removed: []string{strings.Repeat("r", 253)}, Added: sizedGrants(t, "h", exact-1, 256)},
			wantFrames: []int{exact - 1, 1},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, dropped := splitUpdate(tt.in)
			assert.Equal(t, tt.wantDropped, dropped)
			var frames []int
			for _, u := range out {
				frames = append(frames, len(u.GetAdded())+len(u.GetRemoved()))
			}
			assert.Equal(t, tt.wantFrames, frames)
		})
	}
}

// The agent's bound on the grants it writes (fleet.MaxGrantBytes) leaves
// room for what a mint adds to them: a grant at the bound, with the
// longest credential id, a token hash, an expiry and a Secret name, is
// reported whole, and within what a broker holds per grant.
func TestGrantAtTheMintBoundIsReported(t *testing.T) {
	g := &pb.Grant{
		Subject:        &pb.Subject{Username: "system:serviceaccount:argocd:argocd-application-controller", Groups: []string{""}},
		ServiceAccount: &pb.ObjectReference{Namespace: strings.Repeat("n", 63), Name: strings.Repeat("s", 253)},
		Secret:         &pb.ObjectReference{Namespace: strings.Repeat("n", 63)},
		ExpirationTime: timestamppb.Now(),
	}
	for n := fleet.MaxGrantBytes - proto.Size(g); proto.Size(g) != fleet.MaxGrantBytes; n-- {
		g.Subject.Groups[0] = strings.Repeat("g", n)
	}
	require.Equal(t, fleet.MaxGrantBytes, proto.Size(g))
	g.CredentialId = "JTI=" + strings.Repeat("j", selector.MaxJTILength)
	g.TokenSha256 = make([]byte, 32)
	g.Secret.Name = "credbroker-grant-" + strings.Repeat("x", 236)

	out, dropped := splitUpdate(&pb.GrantUpdate{Added: []*pb.Grant{g}})
	assert.Zero(t, dropped, "a grant the agent may write is left out of its reports")
	assert.Len(t, out, 1)
	assert.LessOrEqual(t, proto.Size(g), grants.DefaultMaxGrantBytes, "a grant the agent may write is more than a broker holds")
}

// A grant too large for any frame is left out of the report, and the agent
// says how many it left out; it says nothing when it leaves out none.
func TestHelloLogsTheGrantsItLeavesOut(t *testing.T) {
	tests := []struct {
		name   string
		grants []*pb.Grant
		want   string
	}{
		{name: "none left out", grants: sizedGrants(t, "a", 2, 256)},
		{
			name:   "one too large",
			grants: append(sizedGrants(t, "b", 1, 256), sizedGrants(t, "c", 1, grantChunkBytes+1)...),
			want:   `"level"=0 "msg"="grants too large to report to the broker were left out" "grants"=1`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var lines []string
			log := funcr.New(func(prefix, args string) { lines = append(lines, args) }, funcr.Options{})
			c, err := NewClient(ClientConfig{
				Address: "broker:443", Credentials: insecure.NewCredentials(), Minter: &fakeMinter{},
				Grants: &fakeAgentGrants{snapshots: [][]*pb.Grant{tt.grants}},
			})
			require.NoError(t, err)
			c.hello(log)
			if tt.want == "" {
				assert.Empty(t, lines)
				return
			}
			assert.Equal(t, []string{tt.want}, lines)
		})
	}
}

// A hello, and a grant update, of exactly MaxGrantsPerFrame grants is
// taken; one more closes the stream (TestOversizedGrantFramesCloseTheStream).
func TestFramesOfMaxGrantsAreTaken(t *testing.T) {
	reg := &fakeRegistry{}
	h := newHarness(t, time.Second, withRegistry(reg))
	stream := h.rawStream(t, agentA)
	grants := make([]*pb.Grant, MaxGrantsPerFrame)
	for i := range grants {
		grants[i] = &pb.Grant{CredentialId: fmt.Sprintf("JTI=%d", i)}
	}
	require.NoError(t, stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_Hello{Hello: &pb.Hello{Grants: grants}}}))
	waitConnected(t, h, clusterA, 1)
	require.Eventually(t, func() bool { return reg.replaces() == 1 }, 10*time.Second, 5*time.Millisecond)

	removed := grantIDs(grants)
	require.NoError(t, stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_GrantUpdate{GrantUpdate: &pb.GrantUpdate{Removed: removed}}}))
	require.Eventually(t, func() bool { return len(reg.known()) == 0 }, 10*time.Second, 5*time.Millisecond)
	assert.Equal(t, 1, h.srv.Connected(clusterA), "the stream stays open")
}

// An agent's instance header is kept when it is one value of 1 to 64
// bytes; anything else is no instance.
func TestInstanceOf(t *testing.T) {
	tests := []struct {
		name   string
		values []string
		want   string
	}{
		{name: "none"},
		{name: "one", values: []string{"abc"}, want: "abc"},
		{name: "64 bytes", values: []string{strings.Repeat("i", 64)}, want: strings.Repeat("i", 64)},
		{name: "65 bytes", values: []string{strings.Repeat("i", 65)}},
		{name: "empty", values: []string{""}},
		{name: "two values", values: []string{"a", "b"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			md := metadata.MD{}
			if tt.values != nil {
				md.Append(instanceHeader, tt.values...)
			}
			assert.Equal(t, tt.want, instanceOf(metadata.NewIncomingContext(context.Background(), md)))
		})
	}
}

// A revoke batch holds up to n ids and size bytes, both included; an id
// longer than size goes alone. Repeated and empty ids are dropped.
func TestBatchesAreExact(t *testing.T) {
	id := func(prefix string, i int) string { return fmt.Sprintf("%s%09d", prefix, i) } // 10 bytes
	ids := func(prefix string, n int) []string {
		out := make([]string, n)
		for i := range out {
			out[i] = id(prefix, i)
		}
		return out
	}
	long := strings.Repeat("l", 50)
	tests := []struct {
		name    string
		ids     []string
		n, size int
		want    []int // ids per batch
	}{
		{name: "none", n: 10, size: 30},
		{name: "bytes filled exactly", ids: ids("a", 3), n: 10, size: 30, want: []int{3}},
		{name: "one byte over", ids: ids("b", 4), n: 10, size: 30, want: []int{3, 1}},
		{name: "count filled exactly", ids: ids("c", 2), n: 2, size: 100, want: []int{2}},
		{name: "one id over the count", ids: ids("d", 3), n: 2, size: 100, want: []int{2, 1}},
		{name: "an id longer than a batch", ids: []string{long}, n: 10, size: 30, want: []int{1}},
		{name: "a long id between others", ids: []string{id("e", 0), long, id("e", 1)}, n: 10, size: 30, want: []int{1, 1, 1}},
		{name: "repeats and empty ids", ids: []string{"", id("f", 0), id("f", 0), "", id("f", 1)}, n: 10, size: 30, want: []int{2}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got []int
			var all []string
			for _, b := range batches(tt.ids, tt.n, tt.size) {
				got = append(got, len(b))
				all = append(all, b...)
			}
			assert.Equal(t, tt.want, got)
			var want []string
			for _, id := range tt.ids {
				if id != "" && !slices.Contains(want, id) {
					want = append(want, id)
				}
			}
			assert.Equal(t, want, all, "every distinct id once, in order")
		})
	}
}

// ConnectedClusters counts the clusters with a stream that takes requests
// (credbroker_connected_clusters), and Pending the requests waiting for an
// agent's answer (credbroker_agent_requests_pending), back to 0 once
// answered.
func TestConnectedClustersAndPending(t *testing.T) {
	h := newHarness(t, 5*time.Second)
	clusterB := fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: "fleet", Name: "b"}, UID: "uid-b"}
	agentB := "spiffe://test.example/clusterprofile/fleet/b"
	h.resolver.set(agentB, &clusterB)
	assert.Zero(t, h.srv.ConnectedClusters())

	release := make(chan struct{})
	h.agent(t, agentA, &fakeMinter{fn: func(ctx context.Context, _ *pb.MintRequest) (*pb.MintResponse, error) {
		select {
		case <-release:
		case <-ctx.Done():
		}
		return &pb.MintResponse{Token: testToken, ExpirationTime: timestamppb.New(time.Unix(2e9, 0))}, nil
	}})
	waitConnected(t, h, clusterA, 1)
	assert.Equal(t, 1, h.srv.ConnectedClusters())
	leaving := h.hello(t, agentB)
	waitConnected(t, h, clusterB, 1)
	assert.Equal(t, 2, h.srv.ConnectedClusters())
	require.NoError(t, leaving.Send(goodbye()))
	waitConnected(t, h, clusterB, 0)
	assert.Equal(t, 1, h.srv.ConnectedClusters(), "a cluster whose only stream said goodbye is not connected")

	assert.Zero(t, h.srv.Pending())
	minted := make(chan error, 1)
	go func() {
		_, err := h.srv.Mint(context.Background(), clusterA, &pb.MintRequest{})
		minted <- err
	}()
	require.Eventually(t, func() bool { return h.srv.Pending() == 1 }, 5*time.Second, time.Millisecond)
	close(release)
	require.NoError(t, <-minted)
	assert.Zero(t, h.srv.Pending())
}
