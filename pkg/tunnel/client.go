package tunnel

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"

	"github.com/credbroker/credbroker/pkg/errdefs"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// Minter mints a token for a request that came down the stream. Errors wrap
// errdefs sentinels; their code and message travel back to the broker.
type Minter interface {
	Mint(ctx context.Context, req *pb.MintRequest) (*pb.MintResponse, error)
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
	// Revoke deletes the grants a RevokeRequest names, of the ClusterProfile
	// AdmittedClusterProfile(ctx) names. Errors wrap errdefs sentinels.
	Revoke(ctx context.Context, req *pb.RevokeRequest) (*pb.RevokeResponse, error)
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
	// Cluster, when set ("namespace/name"), is the ClusterProfile the agent
	// expects to serve. A stream the broker admits for another ClusterProfile
	// is closed, logged, and retried with backoff, so a mistaken or hostile
	// ClusterProfile annotation cannot make the agent serve the wrong
	// cluster. Default: serve whichever ClusterProfile the broker names.
	Cluster string
	// MintTimeout bounds one Minter call. Default 10s.
	MintTimeout time.Duration
	// MaxInFlight bounds concurrent Minter calls per stream. Default 64.
	MaxInFlight int
	// Backoff between reconnects: it starts at InitialBackoff, doubles up to
	// MaxBackoff, and each wait is jittered by up to half its length.
	// Defaults 500ms and 30s.
	InitialBackoff, MaxBackoff time.Duration
	// Keepalive is the interval of HTTP/2 pings on an idle connection.
	// Default 30s.
	Keepalive time.Duration
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
	if cfg.InitialBackoff <= 0 {
		cfg.InitialBackoff = 500 * time.Millisecond
	}
	if cfg.MaxBackoff < cfg.InitialBackoff {
		cfg.MaxBackoff = max(30*time.Second, cfg.InitialBackoff)
	}
	if cfg.Keepalive <= 0 {
		cfg.Keepalive = 30 * time.Second
	}
	return &Client{cfg: cfg, connected: make(chan struct{})}, nil
}

// Connected is closed once the broker has admitted a stream.
func (c *Client) Connected() <-chan struct{} { return c.connected }

// Run keeps a stream to the broker open until ctx ends, and then returns nil.
// It reconnects after every failure, each time over a new connection, so
// that the TLS handshake presents the SVID that Credentials holds then: a
// broker ends a stream when the SVID it was opened with expires. Run returns
// an error only when the connection cannot be set up at all.
func (c *Client) Run(ctx context.Context) error {
	opts := append([]grpc.DialOption{
		grpc.WithTransportCredentials(c.cfg.Credentials),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{
			Time:                c.cfg.Keepalive,
			Timeout:             10 * time.Second,
			PermitWithoutStream: true,
		}),
	}, c.cfg.DialOptions...)
	log := c.cfg.Log.WithValues("broker", c.cfg.Address)

	backoff := c.cfg.InitialBackoff
	for {
		conn, err := grpc.NewClient(c.cfg.Address, opts...)
		if err != nil {
			return fmt.Errorf("tunnel: broker %s: %w", c.cfg.Address, err)
		}
		admitted, err := c.serve(ctx, pb.NewAgentTunnelClient(conn), log)
		_ = conn.Close()
		if ctx.Err() != nil {
			return nil
		}
		if admitted {
			backoff = c.cfg.InitialBackoff
		}
		wait := backoff/2 + rand.N(backoff/2+1)
		log.Info("broker stream ended; reconnecting", "reason", errString(err), "after", wait.String())
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return nil
		}
		backoff = min(2*backoff, c.cfg.MaxBackoff)
	}
}

// serve runs one stream until it fails. admitted reports whether the broker
// accepted the stream before it ended.
func (c *Client) serve(ctx context.Context, client pb.AgentTunnelClient, log logr.Logger) (admitted bool, err error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := client.Connect(ctx)
	if err != nil {
		return false, err
	}
	if err := stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_Hello{Hello: c.cfg.Hello}}); err != nil {
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
		return false, err
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
	log.Info("connected to broker", "cluster", cluster)
	ctx = context.WithValue(ctx, admittedKey{}, admission{cluster: cluster, uid: first(md.Get(admittedUIDHeader))})
	c.once.Do(func() { close(c.connected) })

	var (
		sendMu   sync.Mutex
		inFlight = make(chan struct{}, c.cfg.MaxInFlight)
		wg       sync.WaitGroup
	)
	defer func() {
		cancel() // in-flight mints stop with the stream
		wg.Wait()
	}()
	send := func(f *pb.AgentFrame) {
		sendMu.Lock()
		defer sendMu.Unlock()
		if err := stream.Send(f); err != nil {
			log.Info("answer not sent", "correlationID", f.GetCorrelationId(), "err", err.Error())
		}
	}
	for {
		f, err := stream.Recv()
		if err != nil {
			return true, err
		}
		req := f.GetMintRequest()
		if req == nil {
			continue // a frame this agent does not know; newer brokers may send them
		}
		select {
		case inFlight <- struct{}{}:
		case <-ctx.Done():
			return true, ctx.Err()
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-inFlight }()
			send(c.answer(ctx, f.GetCorrelationId(), req))
		}()
	}
}

func (c *Client) answer(ctx context.Context, id string, req *pb.MintRequest) *pb.AgentFrame {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.MintTimeout)
	defer cancel()
	resp, err := c.cfg.Minter.Mint(ctx, req)
	if err == nil && resp != nil {
		return &pb.AgentFrame{CorrelationId: id, Body: &pb.AgentFrame_MintResponse{MintResponse: resp}}
	}
	if err == nil {
		err = errors.New("minter returned no token")
	}
	st := errdefs.ToStatus(err)
	return &pb.AgentFrame{CorrelationId: id, Body: &pb.AgentFrame_Error{Error: &pb.Error{
		Code: int32(st.Code()), Message: st.Message(),
	}}}
}

type admittedKey struct{}

type admission struct{ cluster, uid string }

func first(values []string) string {
	if len(values) == 0 {
		return ""
	}
	return values[0]
}

// AdmittedClusterProfile returns the ClusterProfile ("namespace/name") the
// broker admitted the stream for, from the context the Client passes to
// Minter.Mint and Grants.Revoke; empty for any other context.
func AdmittedClusterProfile(ctx context.Context) string {
	a, _ := ctx.Value(admittedKey{}).(admission)
	return a.cluster
}

// AdmittedClusterProfileUID returns the UID of the ClusterProfile
// incarnation the broker admitted the stream for, like
// AdmittedClusterProfile.
func AdmittedClusterProfileUID(ctx context.Context) string {
	a, _ := ctx.Value(admittedKey{}).(admission)
	return a.uid
}
