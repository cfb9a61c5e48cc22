package tunnel

import (
	"context"
	"sync"

	"github.com/credbroker/credbroker/pkg/fleet"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// SpokeHealth holds what an agent last saw of its spoke API server's
// /readyz, for every stream of the agent to report: in the hello, and in a
// frame of its own whenever it changes. The agent's prober calls Set; the
// Clients that share it (ClientConfig.SpokeHealth) report it. Build it
// with NewSpokeHealth.
type SpokeHealth struct {
	mu      sync.Mutex
	current *pb.SpokeHealth // nil until the first Set
	changed chan struct{}   // closed and replaced by every change
}

// NewSpokeHealth returns a SpokeHealth that reports nothing until Set.
func NewSpokeHealth() *SpokeHealth {
	return &SpokeHealth{changed: make(chan struct{})}
}

// Set records the spoke's readiness. A value equal to the current one
// changes nothing, so that a steady spoke sends no frames.
func (h *SpokeHealth) Set(ready bool, message string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.current != nil && h.current.GetReady() == ready && h.current.GetMessage() == message {
		return
	}
	h.current = &pb.SpokeHealth{Ready: ready, Message: message}
	close(h.changed)
	h.changed = make(chan struct{})
}

// get returns the current report (nil before the first Set; never
// modified once returned) and a channel closed at the next change.
func (h *SpokeHealth) get() (*pb.SpokeHealth, <-chan struct{}) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.current, h.changed
}

// reportSpokeHealth sends every change after sent, the report of the
// stream's hello, until ctx ends.
func reportSpokeHealth(ctx context.Context, h *SpokeHealth, sent *pb.SpokeHealth, send func(*pb.AgentFrame)) {
	for {
		current, changed := h.get()
		if current != sent {
			send(&pb.AgentFrame{Body: &pb.AgentFrame_SpokeHealth{SpokeHealth: current}})
			sent = current
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return
		}
	}
}

// maxSpokeHealthMessage bounds the message of an agent's spoke health
// report that the broker keeps, in bytes: it reaches the ClusterProfile's
// condition, whose message the API server caps at 32 KiB.
const maxSpokeHealthMessage = 512

// setSpokeHealth records an agent's report of its spoke's /readyz.
func (sess *session) setSpokeHealth(h *pb.SpokeHealth) {
	if h == nil {
		sess.spokeHealth.Store(nil)
		return
	}
	sess.spokeHealth.Store(&pb.SpokeHealth{Ready: h.GetReady(), Message: clipAgentString(h.GetMessage(), maxSpokeHealthMessage)})
}

// SpokeReadiness counts the live sessions of a cluster by what their
// agents last reported of the spoke API server's /readyz.
type SpokeReadiness struct {
	// Ready and NotReady count the sessions whose agents reported the
	// spoke ready, and not ready; the others reported nothing.
	Ready, NotReady int
	// Message is the message of the oldest not ready report.
	Message string
}

// SpokeReadiness counts the live sessions of cluster by what their agents
// last reported of the spoke's /readyz.
func (s *Server) SpokeReadiness(cluster fleet.ClusterRef) SpokeReadiness {
	var out SpokeReadiness
	for _, sess := range s.live(cluster) {
		switch h := sess.spokeHealth.Load(); {
		case h == nil:
		case h.GetReady():
			out.Ready++
		default:
			if out.NotReady == 0 {
				out.Message = h.GetMessage()
			}
			out.NotReady++
		}
	}
	return out
}
