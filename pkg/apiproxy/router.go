package apiproxy

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/test/bufconn"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	konnectivity "sigs.k8s.io/apiserver-network-proxy/konnectivity-client/pkg/client"
	clientpb "sigs.k8s.io/apiserver-network-proxy/konnectivity-client/proto/client"
	anpserver "sigs.k8s.io/apiserver-network-proxy/pkg/server"
	"sigs.k8s.io/apiserver-network-proxy/pkg/server/proxystrategies"
	agentpb "sigs.k8s.io/apiserver-network-proxy/proto/agent"
	"sigs.k8s.io/apiserver-network-proxy/proto/header"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
)

// APIServerAddress is the only address a broker asks an agent to dial: the
// agent connects it to its own spoke API server, and refuses every other
// (see Backend). The broker so never learns, or chooses, an address in the
// spoke's network.
const APIServerAddress = "kube-apiserver.credbroker.invalid:443"

// Admitter judges the agents' data path streams, as it judges their
// AgentTunnel streams; *tunnel.Server is one.
type Admitter interface {
	Admit(ctx context.Context) (fleet.Admission, error)
	Readmit(adm fleet.Admission) error
}

// RouterConfig configures a Router.
type RouterConfig struct {
	// Admitter admits agents; required.
	Admitter Admitter
	// ServerID names this broker replica to the agents, which keep one
	// connection to each ServerID; required.
	ServerID string
	// RecheckInterval is how often a live stream is admitted again, so that
	// it ends soon after its ClusterProfile stops naming its agent or the
	// trust bundle drops its CA. Default 1s.
	RecheckInterval time.Duration
	// MaxStreamsPerCluster bounds the data path streams one ClusterProfile
	// may hold to this replica, as the AgentTunnel's. Default 512.
	MaxStreamsPerCluster int
	// DialTimeout bounds one dial through an agent. Default 10s.
	DialTimeout time.Duration
	Log         logr.Logger
	Clock       clock.WithTicker
}

// Router carries connections to spoke API servers over the agents'
// konnectivity streams: it serves the konnectivity AgentService on the
// broker's agent port, keeps one konnectivity proxy server per
// ClusterProfile, to which only the agents admitted for that ClusterProfile
// belong, and dials through them. Build it with NewRouter.
type Router struct {
	agentpb.UnimplementedAgentServiceServer

	cfg RouterConfig

	mu       sync.Mutex
	clusters map[types.NamespacedName]*clusterServer

	// frontend serves the konnectivity ProxyService in memory, for Dial
	// only: it is never on a listener.
	frontend *grpc.Server
	lis      *bufconn.Listener
}

// clusterServer is the konnectivity proxy server of one ClusterProfile
// incarnation, and how many agent streams it holds.
type clusterServer struct {
	uid      types.UID
	srv      *anpserver.ProxyServer
	backends int
}

// clusterHeader and clusterUIDHeader carry, on the in-memory frontend, the
// ClusterProfile a Dial is for.
const (
	clusterHeader    = "credbroker-cluster"
	clusterUIDHeader = "credbroker-cluster-uid"
)

// NewRouter returns a Router; Run serves its in-memory frontend.
func NewRouter(cfg RouterConfig) (*Router, error) {
	if cfg.Admitter == nil || cfg.ServerID == "" {
		return nil, errors.New("apiproxy: Admitter and ServerID are required")
	}
	if cfg.RecheckInterval <= 0 {
		cfg.RecheckInterval = time.Second
	}
	if cfg.MaxStreamsPerCluster <= 0 {
		cfg.MaxStreamsPerCluster = 512
	}
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = 10 * time.Second
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	r := &Router{cfg: cfg, clusters: map[types.NamespacedName]*clusterServer{}, lis: bufconn.Listen(1 << 20)}
	r.frontend = grpc.NewServer()
	clientpb.RegisterProxyServiceServer(r.frontend, frontend{r})
	return r, nil
}

// Run serves the in-memory frontend until ctx ends.
func (r *Router) Run(ctx context.Context) error {
	go func() {
		<-ctx.Done()
		r.frontend.Stop()
	}()
	if err := r.frontend.Serve(r.lis); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return fmt.Errorf("apiproxy: frontend: %w", err)
	}
	return nil
}

// Carriers reports how many agent streams carry cluster's API server.
func (r *Router) Carriers(cluster fleet.ClusterRef) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	if c, ok := r.clusters[cluster.NamespacedName]; ok && c.uid == cluster.UID {
		return c.backends
	}
	return 0
}

// server returns the proxy server of cluster, if it has one and uid is
// its incarnation's.
func (r *Router) server(cluster fleet.ClusterRef) (*anpserver.ProxyServer, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	c, ok := r.clusters[cluster.NamespacedName]
	if !ok || c.uid != cluster.UID {
		return nil, false
	}
	return c.srv, true
}

// join adds one agent stream, admitted as adm, to its cluster's proxy
// server, making it if needed (a new incarnation replaces the old one,
// whose streams Readmit ends), and returns the server and the func that
// takes the stream out again. A stream of another incarnation than the
// server's, with streams, replaces it only if it is admitted still: one
// admitted for an incarnation that was replaced meanwhile would otherwise
// take the newer incarnation's place, and its leaving drop it.
func (r *Router) join(adm fleet.Admission) (*anpserver.ProxyServer, func(), error) {
	cluster := adm.Cluster
	r.mu.Lock()
	defer r.mu.Unlock()
	c, ok := r.clusters[cluster.NamespacedName]
	if ok && c.uid != cluster.UID && c.backends > 0 {
		if err := r.cfg.Admitter.Readmit(adm); err != nil {
			return nil, nil, err
		}
	}
	if ok && c.uid == cluster.UID && c.backends >= r.cfg.MaxStreamsPerCluster {
		return nil, nil, fmt.Errorf("ClusterProfile %s holds %d data path streams to this broker, the most it allows (--max-streams-per-cluster): %w",
			cluster, c.backends, errdefs.ErrResourceExhausted)
	}
	if !ok || c.uid != cluster.UID {
		c = &clusterServer{
			uid: cluster.UID,
			srv: anpserver.NewProxyServer(r.cfg.ServerID, []proxystrategies.ProxyStrategy{proxystrategies.ProxyStrategyDefault},
				1, &anpserver.AgentTokenAuthenticationOptions{}, 16),
		}
		r.clusters[cluster.NamespacedName] = c
	}
	c.backends++
	return c.srv, func() {
		r.mu.Lock()
		defer r.mu.Unlock()
		c.backends--
		if c.backends == 0 && r.clusters[cluster.NamespacedName] == c {
			delete(r.clusters, cluster.NamespacedName)
		}
	}, nil
}

// Connect serves one agent's konnectivity stream: the agent is admitted as
// on the AgentTunnel, and its stream joins the proxy server of its own
// ClusterProfile only, under a name the broker gives it (what the agent
// says of itself is dropped). The stream ends when the agent's SVID
// expires, or when a recheck no longer admits it.
func (r *Router) Connect(stream agentpb.AgentService_ConnectServer) error {
	adm, err := r.cfg.Admitter.Admit(stream.Context())
	if err != nil {
		r.cfg.Log.Info("data path stream refused", fleet.LogAgent, adm.Agent.String(), fleet.LogErr, err.Error())
		return errdefs.ToStatus(err).Err()
	}
	log := r.cfg.Log.WithValues(fleet.LogAgent, adm.Agent.String(), fleet.LogCluster, adm.Cluster.String())
	srv, leave, err := r.join(adm)
	if err != nil {
		log.Info("data path stream refused", fleet.LogErr, err.Error())
		return errdefs.ToStatus(err).Err()
	}
	defer leave()

	ctx, cancel := context.WithCancelCause(stream.Context())
	defer cancel(nil)
	// The konnectivity server names a backend by the agentID header and
	// would route by agentIdentifiers: the broker sets the one to a name of
	// its own and drops the other.
	md, _ := metadata.FromIncomingContext(ctx)
	md = md.Copy()
	md.Set(header.AgentID, adm.Agent.String()+"#"+randomSuffix())
	md.Delete(header.AgentIdentifiers)
	inner := &namedStream{AgentService_ConnectServer: stream, ctx: metadata.NewIncomingContext(ctx, md)}

	done := make(chan error, 1)
	go func() { done <- srv.Connect(inner) }()
	log.Info("data path stream connected", fleet.LogSVIDExpires, adm.Expires.UTC().Format(time.RFC3339))

	expiry := r.cfg.Clock.NewTimer(adm.Expires.Sub(r.cfg.Clock.Now()))
	defer expiry.Stop()
	recheck := r.cfg.Clock.NewTicker(r.cfg.RecheckInterval)
	defer recheck.Stop()
	for {
		select {
		case err := <-done:
			log.Info("data path stream closed", fleet.LogErr, errString(err))
			return nil
		case <-expiry.C():
			err := fmt.Errorf("agent %s: its SVID expired at %s: %w", adm.Agent, adm.Expires.UTC().Format(time.RFC3339), errdefs.ErrUnauthenticated)
			log.Info("data path stream closed by broker", fleet.LogErr, err.Error())
			return errdefs.ToStatus(err).Err()
		case <-recheck.C():
			if err := r.cfg.Admitter.Readmit(adm); err != nil {
				log.Info("data path stream closed by broker", fleet.LogErr, err.Error())
				return errdefs.ToStatus(err).Err()
			}
		}
	}
}

// namedStream is an agent stream with the metadata the broker gave it.
type namedStream struct {
	agentpb.AgentService_ConnectServer
	ctx context.Context
}

func (s *namedStream) Context() context.Context { return s.ctx }

// Dial opens a TCP connection to cluster's spoke API server, carried by
// one of the agent streams of that ClusterProfile incarnation. It fails
// with errdefs.ErrUnavailable when none is connected.
func (r *Router) Dial(ctx context.Context, cluster fleet.ClusterRef) (net.Conn, error) {
	if _, ok := r.server(cluster); !ok {
		return nil, fmt.Errorf("no agent of ClusterProfile %s carries its API server: %w", cluster, errdefs.ErrUnavailable)
	}
	ctx, cancel := context.WithTimeout(ctx, r.cfg.DialTimeout)
	defer cancel()
	// The tunnel lives as long as the connection it carries, not as the
	// dial's ctx.
	tunnelCtx := metadata.AppendToOutgoingContext(context.WithoutCancel(ctx),
		clusterHeader, cluster.String(), clusterUIDHeader, string(cluster.UID))
	t, err := konnectivity.CreateSingleUseGrpcTunnelWithContext(ctx, tunnelCtx, "passthrough:///apiproxy",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return r.lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("open a tunnel to ClusterProfile %s: %v: %w", cluster, err, errdefs.ErrUnavailable)
	}
	conn, err := t.DialContext(ctx, "tcp", APIServerAddress)
	if err != nil {
		return nil, fmt.Errorf("dial the API server of ClusterProfile %s through its agent: %v: %w", cluster, err, errdefs.ErrUnavailable)
	}
	return conn, nil
}

// frontend is the in-memory konnectivity ProxyService: it hands each Dial's
// stream to the proxy server of the ClusterProfile the stream names.
type frontend struct{ r *Router }

func (f frontend) Proxy(stream clientpb.ProxyService_ProxyServer) error {
	md, _ := metadata.FromIncomingContext(stream.Context())
	names, uids := md.Get(clusterHeader), md.Get(clusterUIDHeader)
	if len(names) != 1 || len(uids) != 1 {
		return errdefs.ToStatus(fmt.Errorf("apiproxy: a tunnel names no ClusterProfile: %w", errdefs.ErrInvalidArgument)).Err()
	}
	ns, name, _ := strings.Cut(names[0], "/")
	srv, ok := f.r.server(fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: ns, Name: name}, UID: types.UID(uids[0])})
	if !ok {
		return errdefs.ToStatus(fmt.Errorf("no agent of ClusterProfile %s carries its API server: %w", names[0], errdefs.ErrUnavailable)).Err()
	}
	return srv.Proxy(stream)
}

func randomSuffix() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
