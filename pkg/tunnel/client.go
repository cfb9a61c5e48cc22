package tunnel

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"k8s.io/apimachinery/pkg/types"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// Minter mints a token for a request that came down a stream the broker
// admitted for cluster, the ClusterProfile incarnation its admission
// headers name. Errors wrap errdefs sentinels; their code and message
// travel back to the broker.
type Minter interface {
	Mint(ctx context.Context, cluster fleet.ClusterRef, req *pb.MintRequest) (*pb.MintResponse, error)
}

// Grants is the agent's side of revocation: the grants its tokens are bound
// to (package spoke).
type Grants interface {
	// Snapshot returns the live grants on the spoke that have a credential
	// id; the Client sends them in the hello of every stream. The broker
	// keeps those of the ClusterProfile it admits the stream for.
	Snapshot() []*pb.Grant
	// Subscribe calls fn with every change to the live grants until
	// unsubscribe is called. fn must not block; the Client calls Subscribe
	// before Snapshot, so a change in between is sent twice rather than
	// lost.
	Subscribe(fn func(*pb.GrantUpdate)) (unsubscribe func())
	// Revoke deletes the grants a RevokeRequest names, of cluster, the
	// ClusterProfile incarnation the broker admitted the stream for. Errors
	// wrap errdefs sentinels.
	Revoke(ctx context.Context, cluster fleet.ClusterRef, req *pb.RevokeRequest) (*pb.RevokeResponse, error)
}

// ClientConfig configures a Client.
type ClientConfig struct {
	// Address of one broker replica, host:port; required.
	Address string
	// Credentials authenticate the agent and authorize the broker; required.
	// The agent passes identity.ClientCredentials.
	Credentials credentials.TransportCredentials
	// Minter answers mint requests; required.
	Minter Minter
	// Grants reports the agent's grants and answers revoke requests.
	// Default: no grants, and revoke requests are refused.
	Grants Grants
	// Hello is sent first on every stream. Default: an empty hello.
	Hello *pb.Hello
	// SpokeHealth, when set, is reported in every hello and again on
	// every change. Default: the agent reports no spoke health.
	SpokeHealth *SpokeHealth
	// Cluster, when set ("namespace/name"), is the ClusterProfile the agent
	// expects to serve. A stream the broker admits for another ClusterProfile
	// is closed, logged, and retried with backoff, so a mistaken or hostile
	// ClusterProfile annotation cannot make the agent serve the wrong
	// cluster. Default: serve whichever ClusterProfile the broker names.
	Cluster string
	// MintTimeout bounds one Minter call. Default 10s.
	MintTimeout time.Duration
	// MaxInFlight bounds concurrent Minter and Grants.Revoke calls per
	// stream. Default 64.
	MaxInFlight int
	// MaxQueuedGrantUpdates bounds the grant updates waiting to be sent on
	// a stream. When one more comes, the Client closes the stream: the
	// hello of the next one reports every grant afresh. Default 1024.
	MaxQueuedGrantUpdates int
	// Backoff between reconnects: it starts at InitialBackoff, doubles up to
	// MaxBackoff, and each wait is jittered by up to half its length.
	// Defaults 500ms and 30s.
	InitialBackoff, MaxBackoff time.Duration
	// Keepalive is how long the connection may be silent before the
	// client pings the broker, and KeepaliveTimeout how long it then waits
	// for the answer before it closes the connection and reconnects. Their
	// sum bounds how long a partition without a TCP reset goes unnoticed.
	// Defaults 10s and 5s; gRPC raises a Keepalive under 10s to 10s.
	Keepalive, KeepaliveTimeout time.Duration
	// DrainTimeout bounds how long a stream that is leaving (Run's context
	// ended, or Rotate replaced the stream) waits for its requests in
	// flight. Default 15s.
	DrainTimeout time.Duration
	// Serving, when set, is called with true when the broker admits a
	// stream, and with false once that stream stops serving: the broker
	// said it drains, the stream is leaving, or it ended.
	Serving func(bool)
	// OnBrokerDrain, when set, is called when the broker says it drains:
	// its replica is going away, and a replacement may come at another
	// address. It must not block.
	OnBrokerDrain func()
	// DialOptions are appended to the client's own; tests use them to dial
	// in memory.
	DialOptions []grpc.DialOption
	// Log receives connection events. Default: discard.
	Log logr.Logger
}

// agentIDAnnotation is named in the agent's log; the tunnel does not
// depend on the package that defines it.
const agentIDAnnotation = "credbroker.io/agent-spiffe-id"

// Client is the agent side of AgentTunnel for one broker address.
type Client struct {
	cfg       ClientConfig
	instance  string        // sent in instanceHeader on every stream
	rotate    chan struct{} // Rotate's signal to Run
	connected chan struct{} // closed the first time a stream is admitted
	once      sync.Once
}

// NewClient validates cfg and returns a Client; Run connects it.
func NewClient(cfg ClientConfig) (*Client, error) {
	if cfg.Address == "" || cfg.Credentials == nil || cfg.Minter == nil {
		return nil, errors.New("tunnel: Address, Credentials and Minter are required")
	}
	if cfg.Hello == nil {
		cfg.Hello = &pb.Hello{}
	}
	if cfg.MintTimeout <= 0 {
		cfg.MintTimeout = 10 * time.Second
	}
	if cfg.MaxInFlight <= 0 {
		cfg.MaxInFlight = 64
	}
	if cfg.MaxQueuedGrantUpdates <= 0 {
		cfg.MaxQueuedGrantUpdates = 1024
	}
	if cfg.InitialBackoff <= 0 {
		cfg.InitialBackoff = 500 * time.Millisecond
	}
	if cfg.MaxBackoff < cfg.InitialBackoff {
		cfg.MaxBackoff = max(30*time.Second, cfg.InitialBackoff)
	}
	if cfg.Keepalive <= 0 {
		cfg.Keepalive = 10 * time.Second
	}
	if cfg.KeepaliveTimeout <= 0 {
		cfg.KeepaliveTimeout = 5 * time.Second
	}
	if cfg.DrainTimeout <= 0 {
		cfg.DrainTimeout = 15 * time.Second
	}
	return &Client{cfg: cfg, instance: newCorrelationID(), rotate: make(chan struct{}, 1), connected: make(chan struct{})}, nil
}

// Rotate tells the Client that the SVID that Credentials presents has
// changed. Run opens a stream over a new connection, whose handshake
// presents the new SVID, and once the broker admits it, the old stream
// leaves as it does when Run's context ends: it says goodbye, answers the
// requests it holds (within DrainTimeout) and half-closes. The broker
// already sends new requests down the newest stream of an agent
// (instanceHeader) from the admission on. It does not block.
func (c *Client) Rotate() {
	select {
	case c.rotate <- struct{}{}:
	default:
	}
}

// Connected is closed once the broker has admitted a stream.
func (c *Client) Connected() <-chan struct{} { return c.connected }

// Run keeps a stream to the broker open until ctx ends, and then returns nil
// once every stream has said goodbye and answered its requests in flight
// (within DrainTimeout).
// It reconnects after every failure, each time over a new connection, so
// that the TLS handshake presents the SVID that Credentials holds then: a
// broker ends a stream when the SVID it was opened with expires. After
// Rotate, it opens the next stream before it drains the current one, so
// the agent is never without a stream. Run returns an error only when the
// connection cannot be set up at all.
func (c *Client) Run(ctx context.Context) error {
	opts := append([]grpc.DialOption{
		grpc.WithTransportCredentials(c.cfg.Credentials),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{
			Time:                c.cfg.Keepalive,
			Timeout:             c.cfg.KeepaliveTimeout,
			PermitWithoutStream: true,
		}),
	}, c.cfg.DialOptions...)
	log := c.cfg.Log.WithValues("broker", c.cfg.Address)

	var all sync.WaitGroup
	defer all.Wait()
	start := func() (*generation, error) {
		conn, err := grpc.NewClient(c.cfg.Address, opts...)
		if err != nil {
			return nil, fmt.Errorf("tunnel: broker %s: %w", c.cfg.Address, err)
		}
		g := &generation{admitted: make(chan struct{}), drain: make(chan struct{}), done: make(chan struct{})}
		all.Go(func() {
			defer close(g.done)
			g.wasAdmitted, g.err = c.serve(ctx, pb.NewAgentTunnelClient(conn), log, g)
			_ = conn.Close()
		})
		return g, nil
	}

	b := backoff{initial: c.cfg.InitialBackoff, max: c.cfg.MaxBackoff}
	cur, err := start()
	if err != nil {
		return err
	}
	var (
		next          *generation      // the stream opened after a rotation, until admitted
		reconnect     <-chan time.Time // when cur is nil: the end of the backoff
		retryRotation <-chan time.Time // after a rotated stream failed
		rotating      bool             // a rotation waits for cur's admission
	)
	for {
		if rotating && next == nil && retryRotation == nil && cur != nil && cur.isAdmitted() {
			rotating = false
			if next, err = start(); err != nil {
				return err
			}
			log.Info("SVID rotated; opening a stream with it before draining the old one")
		}
		var curAdmitted, curDone, nextAdmitted, nextDone <-chan struct{}
		if cur != nil {
			curDone = cur.done
			if !cur.seen {
				curAdmitted = cur.admitted
			}
		}
		if next != nil {
			nextAdmitted, nextDone = next.admitted, next.done
		}
		select {
		case <-ctx.Done():
			return nil
		case <-c.rotate:
			rotating = true
		case <-curAdmitted:
			cur.seen = true
			b.reset()
		case <-nextAdmitted:
			if cur != nil {
				log.Info("draining the stream of the old SVID")
				close(cur.drain)
			}
			cur, next = next, nil
			cur.seen = true
			b.reset()
		case <-nextDone:
			wait := b.next(time.Now())
			log.Info("stream with the rotated SVID failed; keeping the old one and trying again", "reason", errString(next.err), "after", wait.String())
			next, retryRotation = nil, time.After(wait)
		case <-retryRotation:
			retryRotation, rotating = nil, true
		case <-curDone:
			if cur.wasAdmitted {
				b.reset()
			}
			if cur.brokerDrained.Load() {
				// The replica is going away; its replacement may listen
				// again at the same address at any moment.
				b.stayShort(time.Now())
			}
			if next != nil {
				cur, next = next, nil
				continue
			}
			wait := b.next(time.Now())
			log.Info("broker stream ended; reconnecting", "reason", errString(cur.err), "after", wait.String())
			cur, reconnect = nil, time.After(wait)
		case <-reconnect:
			reconnect, rotating = nil, false // a new connection presents the SVID of now
			if cur, err = start(); err != nil {
				return err
			}
		}
	}
}

// jitter returns a wait between half of d and d, both included, so that
// agents that lost their broker together do not all come back together.
func jitter(d time.Duration) time.Duration { return d/2 + rand.N(d/2+1) }

// backoff is the wait between reconnects: it starts at initial and doubles
// up to max, each wait jittered (jitter); for max after a broker said it
// drains, it stays at initial, so that the agent finds the replica's
// replacement as soon as it listens.
type backoff struct {
	initial, max time.Duration
	cur          time.Duration // the next wait before jitter; initial when zero
	shortUntil   time.Time
}

func (b *backoff) reset() { b.cur = b.initial }

// stayShort keeps the waits at initial for max from now.
func (b *backoff) stayShort(now time.Time) {
	b.cur, b.shortUntil = b.initial, now.Add(b.max)
}

// next returns the wait before the next reconnect, and doubles the one
// after it unless the waits stay short.
func (b *backoff) next(now time.Time) time.Duration {
	if b.cur <= 0 {
		b.cur = b.initial
	}
	wait := jitter(b.cur)
	if !now.Before(b.shortUntil) {
		b.cur = min(2*b.cur, b.max)
	}
	return wait
}

// generation is one connection and its stream.
type generation struct {
	admitted chan struct{} // closed when the broker admits the stream
	drain    chan struct{} // closed to make the stream leave
	done     chan struct{} // closed when the stream has ended
	seen     bool          // Run has seen admitted closed
	// brokerDrained is set when the broker said it drains.
	brokerDrained atomic.Bool

	// Set before done is closed.
	wasAdmitted bool
	err         error
}

func (g *generation) isAdmitted() bool {
	select {
	case <-g.admitted:
		return true
	default:
		return false
	}
}

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

	stream, err := client.Connect(ctx)
	if err != nil {
		return false, err
	}
	if err := stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_Hello{Hello: hello}}); err != nil {
		if errors.Is(err, io.EOF) {
			// The broker ended the stream already; Recv has its status.
			_, err = stream.Recv()
		}
		return false, err
	}
	// The broker sends headers once it admits the stream; a refusal ends it
	// with a status instead.
	md, err := stream.Header()
	if err != nil {
		return false, causeOf(ctx, err)
	}
	if len(md.Get(admittedHeader)) == 0 {
		// Trailers only: the status says why.
		_, err := stream.Recv()
		return false, err
	}
	cluster := md.Get(admittedHeader)[0]
	if c.cfg.Cluster != "" && cluster != c.cfg.Cluster {
		err := fmt.Errorf("the broker admitted this agent for clusterprofile %s, but it serves %s: "+
			"check the ClusterProfiles' %s annotations and the agent's SVID", cluster, c.cfg.Cluster, agentIDAnnotation)
		log.Error(err, "broker admitted the agent for another ClusterProfile; closing the stream",
			"admittedFor", cluster, "expected", c.cfg.Cluster)
		return false, err
	}
	log.Info("connected to broker", "cluster", cluster, "grants", len(hello.GetGrants())+grantCount(rest))
	admittedFor := admittedCluster(cluster, first(md.Get(admittedUIDHeader)))
	c.once.Do(func() { close(c.connected) })
	if !stopBeforeAdmission() {
		return true, context.Canceled // leave ended before the admission
	}
	close(g.admitted)
	notServing := c.serving()
	defer notServing()

	var (
		sendMu   sync.Mutex
		inFlight = make(chan struct{}, c.cfg.MaxInFlight)
		wg       sync.WaitGroup
	)
	defer func() {
		cancel(nil) // in-flight requests stop with the stream
		wg.Wait()
	}()
	send := func(f *pb.AgentFrame) {
		sendMu.Lock()
		defer sendMu.Unlock()
		if err := stream.Send(f); err != nil {
			log.Info("frame not sent", "correlationID", f.GetCorrelationId(), "err", err.Error())
		}
	}
	closeSend := func() {
		sendMu.Lock()
		defer sendMu.Unlock()
		_ = stream.CloseSend()
	}
	if updates != nil {
		wg.Go(func() { sendGrantUpdates(ctx, rest, updates, send) })
	}
	if c.cfg.SpokeHealth != nil {
		wg.Go(func() { reportSpokeHealth(ctx, c.cfg.SpokeHealth, health, send) })
	}
	wg.Go(func() {
		select {
		case <-leave.Done():
		case <-g.drain: // replaced by the stream of a rotated SVID
		case <-ctx.Done():
			return
		}
		notServing()
		c.leave(ctx, cancel, send, closeSend, inFlight, log)
	})
	for {
		f, err := stream.Recv()
		if err != nil {
			return true, causeOf(ctx, err)
		}
		handle, drain := c.request(f, admittedFor)
		if drain {
			// The broker still sends the requests of its exchanges in
			// flight, and closes the stream when they are done.
			log.Info("broker is draining; serving its last requests until it closes the stream")
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
		case inFlight <- struct{}{}:
		case <-ctx.Done():
			return true, causeOf(ctx, ctx.Err())
		}
		wg.Go(func() {
			defer func() { <-inFlight }()
			answer := handle(ctx)
			if ctx.Err() != nil {
				// The stream is closing: an answer now would race the
				// close, and tell the broker "canceled" instead of letting
				// it hand the request to another stream.
				return
			}
			send(answer)
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
// fit in one frame, and the other grants as updates to send after it.
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
	rest, dropped := splitUpdate(&pb.GrantUpdate{Added: grants})
	if dropped > 0 {
		log.Info("grants too large to report to the broker were left out", "grants", dropped)
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
