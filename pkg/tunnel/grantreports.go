package tunnel

import (
	"context"
	"errors"
	"sync/atomic"

	"github.com/go-logr/logr"
	"google.golang.org/protobuf/proto"

	"github.com/credbroker/credbroker/pkg/fleet"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// errGrantQueueFull ends a stream whose grant updates came faster than it
// could send them.
var errGrantQueueFull = errors.New("grant updates overflowed the stream's queue; the next stream's hello reports every grant")

// causeOf returns why ctx ended, if the Client ended it, or else err.
func causeOf(ctx context.Context, err error) error {
	if cause := context.Cause(ctx); errors.Is(cause, errGrantQueueFull) {
		return cause
	}
	return err
}

// subscribe subscribes to the agent's grant updates for one stream, in a
// queue of MaxQueuedGrantUpdates; when it overflows, it ends the stream with
// end. It returns a nil queue when the agent keeps no grants.
func (c *Client) subscribe(end context.CancelCauseFunc, log logr.Logger) (<-chan *pb.GrantUpdate, func()) {
	if c.cfg.Grants == nil {
		return nil, func() {}
	}
	queue := make(chan *pb.GrantUpdate, c.cfg.MaxQueuedGrantUpdates)
	var full atomic.Bool
	unsubscribe := c.cfg.Grants.Subscribe(func(u *pb.GrantUpdate) {
		select {
		case queue <- u:
		default:
			if full.CompareAndSwap(false, true) {
				log.Info("grant updates overflowed the stream's queue; closing the stream so that the next hello reports every grant",
					"queued", cap(queue))
				end(errGrantQueueFull)
			}
		}
	})
	return queue, unsubscribe
}

// hello returns the hello to send, with as many of the agent's grants as
// fit in one frame, and the updates to send after it: the removals the
// agent remembers, and the other grants.
func (c *Client) hello(log logr.Logger) (*pb.Hello, []*pb.GrantUpdate) {
	if c.cfg.Grants == nil {
		return c.cfg.Hello, nil
	}
	hello := proto.Clone(c.cfg.Hello).(*pb.Hello)
	hello.Grants = nil
	budget := max(0, grantChunkBytes-proto.Size(hello))
	grants := c.cfg.Grants.Snapshot()
	size := 0
	for len(grants) > 0 && len(hello.Grants) < grantChunk {
		n := grantSize(grants[0])
		if size+n > budget {
			break
		}
		hello.Grants, grants, size = append(hello.Grants, grants[0]), grants[1:], size+n
	}
	rest, dropped := splitUpdate(&pb.GrantUpdate{Removed: c.cfg.Grants.Removed(), Added: grants})
	if dropped > 0 {
		log.Info("grants too large to report to the broker were left out", fleet.LogGrants, dropped)
	}
	return hello, rest
}

// Grant reports go in frames of at most grantChunk grants or credential ids
// and about grantChunkBytes, well within the broker's MaxGrantsPerFrame and
// its 64 KiB message limit. A grant larger than grantChunkBytes alone is
// not reported.
const (
	grantChunk      = 256
	grantChunkBytes = 32 << 10
)

// grantSize is the size of g within a frame: itself, its tag and length.
func grantSize(g *pb.Grant) int { return proto.Size(g) + 4 }

// splitUpdate splits u into updates of at most grantChunk entries and
// grantChunkBytes, removals first, in the order the broker applies them. It
// leaves out the grants and ids larger than grantChunkBytes, and returns how
// many.
func splitUpdate(u *pb.GrantUpdate) (out []*pb.GrantUpdate, dropped int) {
	cur, n, size := &pb.GrantUpdate{}, 0, 0
	fit := func(sz int) bool {
		if sz > grantChunkBytes {
			dropped++
			return false
		}
		if n == grantChunk || size+sz > grantChunkBytes {
			out, cur, n, size = append(out, cur), &pb.GrantUpdate{}, 0, 0
		}
		n, size = n+1, size+sz
		return true
	}
	for _, id := range u.GetRemoved() {
		if fit(len(id) + 4) {
			cur.Removed = append(cur.Removed, id)
		}
	}
	for _, g := range u.GetAdded() {
		if fit(grantSize(g)) {
			cur.Added = append(cur.Added, g)
		}
	}
	if n > 0 {
		out = append(out, cur)
	}
	return out, dropped
}

func grantCount(us []*pb.GrantUpdate) int {
	n := 0
	for _, u := range us {
		n += len(u.GetAdded())
	}
	return n
}

// sendGrantUpdates sends the grants that did not fit in the hello, then
// every update from queue, until ctx ends.
func sendGrantUpdates(ctx context.Context, rest []*pb.GrantUpdate, queue <-chan *pb.GrantUpdate, send func(*pb.AgentFrame)) {
	frame := func(u *pb.GrantUpdate) *pb.AgentFrame {
		return &pb.AgentFrame{Body: &pb.AgentFrame_GrantUpdate{GrantUpdate: u}}
	}
	for _, u := range rest {
		if ctx.Err() != nil {
			return
		}
		send(frame(u))
	}
	for {
		select {
		case <-ctx.Done():
			return
		case u := <-queue:
			parts, _ := splitUpdate(u)
			for _, part := range parts {
				send(frame(part))
			}
		}
	}
}
