package tunnel

import (
	"fmt"

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
	for key, ch := range s.arrived {
		close(ch) // the mints waiting for an agent to return fail now
		delete(s.arrived, key)
	}
	var all []*session
	for _, list := range s.sessions {
		all = append(all, list...)
	}
	return all
}
