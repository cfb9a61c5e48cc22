package tunnel

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/credentials/insecure"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// mintIn returns a mint request for a ServiceAccount of namespace ns.
func mintIn(ns string) *pb.MintRequest {
	return &pb.MintRequest{ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: "deployer"}}
}

// Attack (docs/security.md 32.13): the agents of a spoke each keep pooled
// grants in the namespaces they mint in, and those count against the
// namespace's Secret quota. Round robin sent a namespace's mints to every
// agent in turn, so the namespace held the pooled grants of every agent
// of the spoke: a quota that its live tokens fit in was filled, and mints
// were refused.
// Defence: a namespace's mints go to one agent; only consumers that let
// the agent pick the ServiceAccount go by their subject instead.
func TestMintsOfANamespaceGoToOneAgent(t *testing.T) {
	h := newHarness(t, time.Second)
	m1, m2 := &fakeMinter{}, &fakeMinter{}
	h.agent(t, agentA, m1)
	h.agent(t, agentA, m2)
	waitConnected(t, h, clusterA, 2)

	mint := func(req *pb.MintRequest) {
		t.Helper()
		_, err := h.srv.Mint(context.Background(), clusterA, req)
		require.NoError(t, err)
	}
	calls := func() [2]int32 { return [2]int32{m1.calls.Load(), m2.calls.Load()} }
	oneAgent := func(before, after [2]int32, n int32) bool {
		return after[0]-before[0] == n && after[1] == before[1] || after[1]-before[1] == n && after[0] == before[0]
	}

	before := calls()
	for i := range 10 {
		req := mintIn("apps")
		req.Subject = &pb.Subject{Username: fmt.Sprintf("consumer-%d", i)}
		mint(req)
	}
	assert.True(t, oneAgent(before, calls(), 10), "the mints of one namespace went to both agents: %v then %v", before, calls())

	before = calls()
	for range 10 {
		mint(&pb.MintRequest{Subject: &pb.Subject{Username: "alice"}})
	}
	assert.True(t, oneAgent(before, calls(), 10), "the mints of one subject, naming no ServiceAccount, went to both agents: %v then %v", before, calls())

	// Many namespaces spread over both agents (each picks either with even
	// odds: all 32 on one agent has odds of 2^-31).
	before = calls()
	for i := range 32 {
		mint(mintIn(fmt.Sprintf("ns-%d", i)))
	}
	after := calls()
	assert.Positive(t, after[0]-before[0], "no namespace picked the first agent")
	assert.Positive(t, after[1]-before[1], "no namespace picked the second agent")
}

// Every broker replica sees the same agents, though not in the same order:
// each must send a namespace's mints to the same agent, and when that
// agent goes, only its namespaces move.
func TestPickIsTheSameOnEveryReplica(t *testing.T) {
	id := spiffeid.RequireFromString("spiffe://example.org/clusterprofile/fleet/a")
	var sessions []*session
	for i := range 5 {
		sessions = append(sessions, &session{agent: id, instance: fmt.Sprintf("instance-%d", i)})
	}
	reversed := slices.Clone(sessions)
	slices.Reverse(reversed)

	for i := range 50 {
		key := mintKey(mintIn(fmt.Sprintf("ns-%d", i)))
		first := pick(sessions, key, nil)
		require.NotNil(t, first)
		assert.Same(t, first, pick(reversed, key, nil), "two replicas picked different agents for %q", key)

		gone := sessions[0]
		without := pick(sessions, key, map[*session]bool{gone: true})
		if first != gone {
			assert.Same(t, first, without, "%q moved though its agent stayed", key)
		} else {
			assert.NotSame(t, gone, without)
		}
	}
	assert.Nil(t, pick(sessions[:1], "k", map[*session]bool{sessions[0]: true}), "a tried session was picked again")
}

// Two broker replicas, and two agents with a stream to each: an agent
// that names all its streams alike (ClientConfig.Instance) is ranked
// alike by both replicas, so a namespace's mints through either go to it.
func TestReplicasSendANamespaceToTheSameAgent(t *testing.T) {
	replicas := []*harness{newHarness(t, time.Second), newHarness(t, time.Second)}
	minters := []*fakeMinter{{}, {}}
	for _, m := range minters {
		instance := NewInstance()
		for _, h := range replicas {
			h.agent(t, agentA, m, func(c *ClientConfig) { c.Instance = instance })
		}
	}
	for _, h := range replicas {
		waitConnected(t, h, clusterA, 2)
	}
	for i := range 16 {
		req := mintIn(fmt.Sprintf("ns-%d", i))
		var picked []int
		for _, h := range replicas {
			before := []int32{minters[0].calls.Load(), minters[1].calls.Load()}
			_, err := h.srv.Mint(context.Background(), clusterA, req)
			require.NoError(t, err)
			for j, m := range minters {
				if m.calls.Load() > before[j] {
					picked = append(picked, j)
				}
			}
		}
		assert.Equal(t, picked[0], picked[1], "namespace ns-%d went to two agents through two replicas", i)
	}
}

func TestClientInstanceIsBounded(t *testing.T) {
	_, err := NewClient(ClientConfig{Address: "a", Credentials: insecure.NewCredentials(), Minter: &fakeMinter{}, Instance: strings.Repeat("i", 65)})
	assert.ErrorContains(t, err, "Instance is 65 bytes, more than 64")
}
