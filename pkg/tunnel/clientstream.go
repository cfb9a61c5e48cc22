package tunnel

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"

	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"k8s.io/apimachinery/pkg/types"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// serve runs the stream of g until it fails, or until ctx ends or g.drain
// is closed and the stream has said goodbye (see leave). admitted reports
// whether the broker accepted the stream before it ended. It closes
// g.admitted once the broker admits the stream, and sets g.brokerDrained
// when the broker says it drains.
func (c *Client) serve(ctx context.Context, client pb.AgentTunnelClient, log logr.Logger, g *generation) (admitted bool, err error) {
	leave := ctx
	// The stream outlives ctx by its goodbye; until the broker admits it,
	// there is nothing to finish.
	ctx, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	defer cancel(nil)
	stopBeforeAdmission := context.AfterFunc(leave, func() { cancel(context.Canceled) })
	defer stopBeforeAdmission()
	ctx = metadata.AppendToOutgoingContext(ctx, instanceHeader, c.instance)
	// Subscribe before Snapshot: an update in between is sent twice rather
	// than lost.
	updates, unsubscribe := c.subscribe(cancel, log)
	defer unsubscribe()
	hello, rest := c.hello(log)
	var health *pb.SpokeHealth
	if c.cfg.SpokeHealth != nil {
		health, _ = c.cfg.SpokeHealth.get()
		hello = proto.CloneOf(hello)
		hello.SpokeHealth = health
	}

	stream, md, err := c.open(ctx, client, hello, log)
	if stream == nil {
		return false, err
	}
	cluster := md.Get(admittedHeader)[0]
	log.Info("connected to broker", fleet.LogCluster, cluster, fleet.LogGrants, len(hello.GetGrants())+grantCount(rest))
	admittedFor := admittedCluster(cluster, first(md.Get(admittedUIDHeader)))
	c.once.Do(func() { close(c.connected) })
	if !stopBeforeAdmission() {
		return true, context.Canceled // leave ended before the admission
	}
	close(g.admitted)
	notServing := c.serving()
	defer notServing()

	bs := &brokerStream{stream: stream, log: log, inFlight: make(chan struct{}, c.cfg.MaxInFlight)}
	defer func() {
		cancel(nil) // in-flight requests stop with the stream
		bs.wg.Wait()
	}()
	if updates != nil {
		bs.wg.Go(func() { sendGrantUpdates(ctx, rest, updates, bs.send) })
	}
	if c.cfg.SpokeHealth != nil {
		bs.wg.Go(func() { reportSpokeHealth(ctx, c.cfg.SpokeHealth, health, bs.send) })
	}
	bs.wg.Go(func() {
		select {
		case <-leave.Done():
		case <-g.drain: // replaced by the stream of a rotated SVID
		case <-ctx.Done():
			return
		}
		notServing()
		c.leave(ctx, cancel, bs.send, bs.closeSend, bs.inFlight, log)
	})
	return true, c.receive(ctx, bs, admittedFor, g, notServing)
}

// open opens a stream, sends hello and waits for the broker's admission
// headers, which it returns with the stream. Without a stream, the error
// says why: the broker refused the stream, or it admitted the agent for
// another ClusterProfile than ClientConfig.Cluster.
func (c *Client) open(ctx context.Context, client pb.AgentTunnelClient, hello *pb.Hello, log logr.Logger) (
	grpc.BidiStreamingClient[pb.AgentFrame, pb.BrokerFrame], metadata.MD, error) {
	stream, err := client.Connect(ctx)
	if err != nil {
		return nil, nil, err
	}
	if err := stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_Hello{Hello: hello}}); err != nil {
		if errors.Is(err, io.EOF) {
			// The broker ended the stream already; Recv has its status.
			_, err = stream.Recv()
		}
		return nil, nil, err
	}
	// The broker sends headers once it admits the stream; a refusal ends it
	// with a status instead.
	md, err := stream.Header()
	if err != nil {
		return nil, nil, causeOf(ctx, err)
	}
	if len(md.Get(admittedHeader)) == 0 {
		// Trailers only: the status says why.
		_, err := stream.Recv()
		return nil, nil, err
	}
	if cluster := md.Get(admittedHeader)[0]; c.cfg.Cluster != "" && cluster != c.cfg.Cluster {
		err := fmt.Errorf("the broker admitted this agent for clusterprofile %s, but it serves %s: "+
			"check the ClusterProfiles' %s annotations and the agent's SVID", cluster, c.cfg.Cluster, agentIDAnnotation)
		log.Error(err, "broker admitted the agent for another ClusterProfile; closing the stream",
			fleet.LogAdmittedFor, cluster, "expected", c.cfg.Cluster)
		return nil, nil, err
	}
	return stream, md, nil
}

// brokerStream is an admitted stream of a Client: its frames are sent one
// at a time, and inFlight bounds the requests it serves at once, each in a
// goroutine of wg.
type brokerStream struct {
	stream   grpc.BidiStreamingClient[pb.AgentFrame, pb.BrokerFrame]
	log      logr.Logger
	mu       sync.Mutex // serializes sends
	inFlight chan struct{}
	wg       sync.WaitGroup
}

func (bs *brokerStream) send(f *pb.AgentFrame) {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	if err := bs.stream.Send(f); err != nil {
		bs.log.Info("frame not sent", "correlationID", f.GetCorrelationId(), fleet.LogErr, err.Error())
	}
}

func (bs *brokerStream) closeSend() {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	_ = bs.stream.CloseSend()
}

// receive reads the broker's frames on bs, admitted for cluster, until the
// stream fails or ctx ends: each request is answered in a goroutine, once a
// slot of inFlight is free, and a drain is reported (OnBrokerDrain,
// g.brokerDrained, notServing).
func (c *Client) receive(ctx context.Context, bs *brokerStream, cluster fleet.ClusterRef, g *generation, notServing func()) error {
	for {
		f, err := bs.stream.Recv()
		if err != nil {
			return causeOf(ctx, err)
		}
		handle, drain := c.request(f, cluster)
		if drain {
			// The broker still sends the requests of its exchanges in
			// flight, and closes the stream when they are done.
			bs.log.Info("broker is draining; serving its last requests until it closes the stream")
			if !g.brokerDrained.Swap(true) && c.cfg.OnBrokerDrain != nil {
				c.cfg.OnBrokerDrain()
			}
			notServing()
			continue
		}
		if handle == nil {
			continue // a frame this agent does not know; newer brokers may send them
		}
		select {
		case bs.inFlight <- struct{}{}:
		case <-ctx.Done():
			return causeOf(ctx, ctx.Err())
		}
		bs.wg.Go(func() {
			defer func() { <-bs.inFlight }()
			answer := handle(ctx)
			if ctx.Err() != nil {
				// The stream is closing: an answer now would race the
				// close, and tell the broker "canceled" instead of letting
				// it hand the request to another stream.
				return
			}
			bs.send(answer)
		})
	}
}

// request reads a frame from the broker on a stream admitted for cluster:
// handle answers a mint or a revoke request with a frame of the same
// correlation id, and drain reports that the broker drains. A frame of any
// other kind, which a newer broker may send, has neither.
func (c *Client) request(f *pb.BrokerFrame, cluster fleet.ClusterRef) (handle func(ctx context.Context) *pb.AgentFrame, drain bool) {
	switch body := f.GetBody().(type) {
	case *pb.BrokerFrame_MintRequest:
		return func(ctx context.Context) *pb.AgentFrame {
			return c.answer(ctx, f.GetCorrelationId(), cluster, body.MintRequest)
		}, false
	case *pb.BrokerFrame_RevokeRequest:
		return func(ctx context.Context) *pb.AgentFrame {
			return c.revoke(ctx, f.GetCorrelationId(), cluster, body.RevokeRequest)
		}, false
	case *pb.BrokerFrame_Drain:
		return nil, true
	default:
		return nil, false
	}
}

func (c *Client) answer(ctx context.Context, id string, cluster fleet.ClusterRef, req *pb.MintRequest) *pb.AgentFrame {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.MintTimeout)
	defer cancel()
	resp, err := c.cfg.Minter.Mint(ctx, cluster, req)
	if err == nil && resp != nil {
		return &pb.AgentFrame{CorrelationId: id, Body: &pb.AgentFrame_MintResponse{MintResponse: resp}}
	}
	if err == nil {
		err = errors.New("minter returned no token")
	}
	return errorFrame(id, err)
}

// errNoGrants answers revoke requests to an agent without Grants.
var errNoGrants = fmt.Errorf("this agent keeps no grants: %w", errdefs.ErrFailedPrecondition)

func (c *Client) revoke(ctx context.Context, id string, cluster fleet.ClusterRef, req *pb.RevokeRequest) *pb.AgentFrame {
	if c.cfg.Grants == nil {
		return errorFrame(id, errNoGrants)
	}
	ctx, cancel := context.WithTimeout(ctx, c.cfg.MintTimeout)
	defer cancel()
	resp, err := c.cfg.Grants.Revoke(ctx, cluster, req)
	if err == nil && resp != nil {
		return &pb.AgentFrame{CorrelationId: id, Body: &pb.AgentFrame_RevokeResponse{RevokeResponse: resp}}
	}
	if err == nil {
		err = errors.New("grants returned no answer to a revoke")
	}
	return errorFrame(id, err)
}

func errorFrame(id string, err error) *pb.AgentFrame {
	st := errdefs.ToStatus(err)
	return &pb.AgentFrame{CorrelationId: id, Body: &pb.AgentFrame_Error{Error: &pb.Error{
		Code: int32(st.Code()), Message: st.Message(),
	}}}
}

// admittedCluster reads the ClusterProfile incarnation that a broker's
// admission headers name: name ("namespace/name") and uid.
func admittedCluster(name, uid string) fleet.ClusterRef {
	namespace, name, _ := strings.Cut(name, "/")
	return fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: namespace, Name: name}, UID: types.UID(uid)}
}

func first(values []string) string {
	if len(values) == 0 {
		return ""
	}
	return values[0]
}
