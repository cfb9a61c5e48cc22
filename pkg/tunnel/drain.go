package tunnel

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/go-logr/logr"

	"github.com/credbroker/credbroker/pkg/errdefs"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// errDraining refuses the streams that agents open to a draining broker.
var errDraining = fmt.Errorf("this broker replica is draining; connect to another replica: %w", errdefs.ErrUnavailable)

// Drain tells every agent stream that this broker replica is shutting down,
// and refuses new streams with Unavailable from now on. The streams stay
// open and keep serving the requests the broker still sends (those of the
// exchanges in flight) until Close. Drain returns once every live stream
// has the Drain frame queued, or in a goroutine for a stream whose queue is
// full (a stuck agent must not hold up the broker's shutdown).
func (s *Server) Drain() {
	for _, sess := range s.stopAdmitting() {
		f := &pb.BrokerFrame{Body: &pb.BrokerFrame_Drain{Drain: &pb.Drain{}}}
		select {
		case sess.out <- f:
		default:
			go func() {
				select {
				case sess.out <- f:
				case <-sess.ctx.Done():
				}
			}()
		}
	}
}

// Close ends every agent stream with Unavailable and refuses new ones. The
// broker calls it at the end of its drain, once the exchanges in flight are
// done.
func (s *Server) Close() {
	for _, sess := range s.stopAdmitting() {
		sess.cancel(fmt.Errorf("the broker replica is shutting down: %w", errdefs.ErrUnavailable))
	}
}

// stopAdmitting marks the Server draining and returns its sessions. A
// session that add admits later would miss the Drain frame, so add refuses
// them under the same lock.
func (s *Server) stopAdmitting() []*session {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.draining = true
	var all []*session
	for _, list := range s.sessions {
		all = append(all, list...)
	}
	return all
}

// errLeft ends a stream that said goodbye.
var errLeft = errors.New("the agent left")

// leave says goodbye on the stream (Run's context ended, or the stream of a
// rotated SVID replaced it), so that the broker sends no new request down
// it, then waits for the requests in flight by taking every slot of
// inFlight (which also keeps new requests from starting), and half-closes
// the stream: the broker reads every answer before the end, and then ends
// the stream. All within DrainTimeout, after which it ends the stream
// itself. A request the broker sent before it read the goodbye and that no
// slot took finds the stream closed: the broker hands it to another stream.
func (c *Client) leave(ctx context.Context, end context.CancelCauseFunc, send func(*pb.AgentFrame), closeSend func(),
	inFlight chan struct{}, log logr.Logger) {
	log.Info("leaving the broker; answering the requests in flight", "inFlight", len(inFlight))
	send(&pb.AgentFrame{Body: &pb.AgentFrame_Goodbye{Goodbye: &pb.Goodbye{}}})
	timeout := time.NewTimer(c.cfg.DrainTimeout)
	defer timeout.Stop()
	expired := func() {
		log.Info("the stream did not end within the drain timeout; closing it", "inFlight", len(inFlight), "timeout", c.cfg.DrainTimeout.String())
		end(errLeft)
	}
	for range cap(inFlight) {
		select {
		case inFlight <- struct{}{}:
		case <-timeout.C:
			expired()
			return
		case <-ctx.Done():
			return
		}
	}
	// Cancelling the stream now could overtake the last answers.
	closeSend()
	select {
	case <-timeout.C:
		expired()
	case <-ctx.Done():
	}
}

// serving reports an admitted stream to Serving, and returns the func that
// reports, once, that it stopped serving.
func (c *Client) serving() func() {
	if c.cfg.Serving == nil {
		return func() {}
	}
	c.cfg.Serving(true)
	return sync.OnceFunc(func() { c.cfg.Serving(false) })
}
