package tunnel

import (
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/types"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// An agent's spoke health reaches the broker in the hello and on every
// change, and the broker hears of each change.
func TestSpokeHealthIsReported(t *testing.T) {
	var changes atomic.Int64
	h := newHarness(t, 5*time.Second, func(c *ServerConfig) {
		c.OnSessionsChange = func(types.NamespacedName) { changes.Add(1) }
	})
	health := NewSpokeHealth()
	health.Set(true, "")
	h.agent(t, agentA, &fakeMinter{}, func(c *ClientConfig) { c.SpokeHealth = health })
	waitConnected(t, h, clusterA, 1)
	assert.Equal(t, SpokeReadiness{Ready: 1}, h.srv.SpokeReadiness(clusterA), "the hello carries it")

	before := changes.Load()
	health.Set(false, "/readyz reports [-]etcd failed: reason withheld")
	require.Eventually(t, func() bool { return h.srv.SpokeReadiness(clusterA).NotReady == 1 }, 10*time.Second, 5*time.Millisecond)
	assert.Equal(t, SpokeReadiness{NotReady: 1, Message: "/readyz reports [-]etcd failed: reason withheld"}, h.srv.SpokeReadiness(clusterA))
	assert.Greater(t, changes.Load(), before, "the publisher hears of the change")

	health.Set(true, "")
	require.Eventually(t, func() bool { return h.srv.SpokeReadiness(clusterA) == SpokeReadiness{Ready: 1} }, 10*time.Second, 5*time.Millisecond)
}

// What an agent says of its spoke is its own: the broker keeps a bounded,
// loggable message, and an agent that reports nothing counts as neither.
func TestSpokeHealthReportIsBounded(t *testing.T) {
	h := newHarness(t, 5*time.Second)
	stream := h.rawStream(t, agentA)
	require.NoError(t, stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_Hello{Hello: &pb.Hello{}}}))
	waitConnected(t, h, clusterA, 1)
	assert.Equal(t, SpokeReadiness{}, h.srv.SpokeReadiness(clusterA))

	long := strings.Repeat("x", 64<<10-64)
	require.NoError(t, stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_SpokeHealth{SpokeHealth: &pb.SpokeHealth{Message: "\x1b[2J" + long}}}))
	require.Eventually(t, func() bool { return h.srv.SpokeReadiness(clusterA).NotReady == 1 }, 10*time.Second, 5*time.Millisecond)
	msg := h.srv.SpokeReadiness(clusterA).Message
	assert.LessOrEqual(t, len(msg), maxSpokeHealthMessage+len("..."))
	assert.NotContains(t, msg, "\x1b")
}

func TestSpokeHealthSetSendsOnlyChanges(t *testing.T) {
	h := NewSpokeHealth()
	first, changed := h.get()
	assert.Nil(t, first)
	h.Set(true, "")
	select {
	case <-changed:
	default:
		t.Fatal("a first report is a change")
	}
	cur, changed := h.get()
	h.Set(true, "")
	select {
	case <-changed:
		t.Fatal("the same report again is no change")
	default:
	}
	again, _ := h.get()
	assert.Same(t, cur, again)
}
