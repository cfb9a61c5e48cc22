package tunnel

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"

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
	// Removed returns the credential ids of grants deleted while their
	// tokens were live; the Client sends them after the hello of every
	// stream, so that a broker replica whose stream was down when a grant
	// went still learns of it.
	Removed() []string
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
	// Instance names the agent process to the broker (instanceHeader), 1
	// to 64 bytes. Give every Client of one agent the same one
	// (NewInstance): broker replicas pick the agent of a namespace's mints
	// by it (Server.Mint), and they agree only if the agent has one name
	// for all of them. Default: a new one per Client.
	Instance string
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

// Defaults of ClientConfig; its MintTimeout defaults to DefaultMintTimeout.
const (
	DefaultMaxInFlight           = 64
	DefaultMaxQueuedGrantUpdates = 1024
	DefaultInitialBackoff        = 500 * time.Millisecond
	DefaultMaxBackoff            = 30 * time.Second
	DefaultKeepalive             = 10 * time.Second
	DefaultKeepaliveTimeout      = 5 * time.Second
	DefaultDrainTimeout          = 15 * time.Second
)

// NewClient validates cfg and returns a Client; Run connects it.
func NewClient(cfg ClientConfig) (*Client, error) {
	if cfg.Address == "" || cfg.Credentials == nil || cfg.Minter == nil {
		return nil, errors.New("tunnel: Address, Credentials and Minter are required")
	}
	if len(cfg.Instance) > maxInstance {
		return nil, fmt.Errorf("tunnel: Instance is %d bytes, more than %d", len(cfg.Instance), maxInstance)
	}
	if cfg.Hello == nil {
		cfg.Hello = &pb.Hello{}
	}
	cfg.MintTimeout = orDefault(cfg.MintTimeout, DefaultMintTimeout)
	cfg.MaxInFlight = orDefault(cfg.MaxInFlight, DefaultMaxInFlight)
	cfg.MaxQueuedGrantUpdates = orDefault(cfg.MaxQueuedGrantUpdates, DefaultMaxQueuedGrantUpdates)
	cfg.InitialBackoff = orDefault(cfg.InitialBackoff, DefaultInitialBackoff)
	if cfg.MaxBackoff < cfg.InitialBackoff {
		cfg.MaxBackoff = max(DefaultMaxBackoff, cfg.InitialBackoff)
	}
	cfg.Keepalive = orDefault(cfg.Keepalive, DefaultKeepalive)
	cfg.KeepaliveTimeout = orDefault(cfg.KeepaliveTimeout, DefaultKeepaliveTimeout)
	cfg.DrainTimeout = orDefault(cfg.DrainTimeout, DefaultDrainTimeout)
	instance := cfg.Instance
	if instance == "" {
		instance = NewInstance()
	}
	return &Client{cfg: cfg, instance: instance, rotate: make(chan struct{}, 1), connected: make(chan struct{})}, nil
}

// NewInstance returns a random name for an agent process: its
// ClientConfig.Instance.
func NewInstance() string { return newCorrelationID() }

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
	log := c.cfg.Log.WithValues(fleet.LogBroker, c.cfg.Address)
	var all sync.WaitGroup
	defer all.Wait()
	b := backoff{initial: c.cfg.InitialBackoff, max: c.cfg.MaxBackoff}
	cur, err := c.start(ctx, &all, log)
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
			if next, err = c.start(ctx, &all, log); err != nil {
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
			log.Info("stream with the rotated SVID failed; keeping the old one and trying again", fleet.LogErr, errString(next.err), "after", wait.String())
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
			log.Info("broker stream ended; reconnecting", fleet.LogErr, errString(cur.err), "after", wait.String())
			cur, reconnect = nil, time.After(wait)
		case <-reconnect:
			reconnect, rotating = nil, false // a new connection presents the SVID of now
			if cur, err = c.start(ctx, &all, log); err != nil {
				return err
			}
		}
	}
}

// start opens a new connection to the broker, whose handshake presents the
// SVID that Credentials holds now, and serves a stream over it in a
// goroutine of all; the generation it returns follows that stream.
func (c *Client) start(ctx context.Context, all *sync.WaitGroup, log logr.Logger) (*generation, error) {
	opts := append([]grpc.DialOption{
		grpc.WithTransportCredentials(c.cfg.Credentials),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{
			Time:                c.cfg.Keepalive,
			Timeout:             c.cfg.KeepaliveTimeout,
			PermitWithoutStream: true,
		}),
	}, c.cfg.DialOptions...)
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
