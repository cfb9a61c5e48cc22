package tunnel

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/go-logr/logr"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

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
