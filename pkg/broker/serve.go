package broker

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"
	"k8s.io/client-go/tools/cache"
	agentpb "sigs.k8s.io/apiserver-network-proxy/proto/agent"

	"github.com/credbroker/credbroker/internal/probe"
	"github.com/credbroker/credbroker/pkg/grants"
	"github.com/credbroker/credbroker/pkg/identity"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// Run serves until ctx ends, then stops gracefully within ShutdownGrace. The
// first part that fails stops the others, and Run returns its error.
func (b *Broker) Run(ctx context.Context) error {
	defer b.closeListeners()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return b.svid.Run(ctx) })
	g.Go(func() error { return b.keyPair.Run(ctx) })
	g.Go(func() error { return b.keys.Run(ctx) })

	shutdown := b.startInformers(ctx, g)
	defer shutdown()
	if synced, err := b.waitSynced(ctx, cancel, g); !synced {
		return err
	}

	if b.publisher != nil {
		g.Go(func() error { return b.runPublisher(ctx) })
	}

	exchange, agents := b.exchangeServer(), b.agentServer()
	stopRouter := b.serve(ctx, g, exchange, agents)
	defer stopRouter()

	b.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	b.log.Info("broker serving", "exchange", b.ExchangeAddr(), "agents", b.AgentAddr(), "trustDomain", b.cfg.TrustDomain.String())
	err := g.Wait()
	b.health.Shutdown()
	return err
}

// startInformers starts the hub informers, and in g the pending store and
// the revocation triggers that they feed. The returned func shuts the
// informers down.
func (b *Broker) startInformers(ctx context.Context, g *errgroup.Group) (shutdown func()) {
	b.informers.Start(ctx.Done())
	b.rbacInformers.Start(ctx.Done())
	b.accountInformers.Start(ctx.Done())
	b.pendingInformers.Start(ctx.Done())
	g.Go(func() error { return b.pending.Run(ctx) })
	g.Go(func() error { return b.runTriggers(ctx) })
	return func() {
		b.pendingInformers.Shutdown()
		b.accountInformers.Shutdown()
		b.rbacInformers.Shutdown()
		b.informers.Shutdown()
	}
}

// waitSynced waits, for CacheSyncTimeout at most, for the ClusterProfile
// and pending revokes informers to sync. When they do not, it cancels the
// parts running in g and returns false with what Run returns: the first
// part's failure, nil when ctx ended, or else why they did not sync.
func (b *Broker) waitSynced(ctx context.Context, cancel context.CancelFunc, g *errgroup.Group) (bool, error) {
	syncCtx, cancelSync := context.WithTimeout(ctx, b.cfg.CacheSyncTimeout)
	// Agents are served only once the revokes that other replicas recorded
	// are known, to be sent again when the agents connect.
	synced := cache.WaitForCacheSync(syncCtx.Done(), b.profiles.HasSynced, b.pending.HasSynced)
	cancelSync()
	if synced {
		return true, nil
	}
	stopped := ctx.Err() != nil // by the caller, or by a failing part
	cancel()
	if err := g.Wait(); err != nil || stopped {
		return false, err
	}
	return false, fmt.Errorf("broker: the ClusterProfile and pending revokes informers did not sync within %s; check the hub connection, that the ClusterProfile CRD is installed, "+
		"and that the broker may list and watch ConfigMap %s/%s (deploy/hub/rbac.yaml)", b.cfg.CacheSyncTimeout, b.cfg.PendingRevokesNamespace, grants.DefaultPendingConfigMap)
}

// exchangeServer is the gRPC server of the exchange port: TokenExchange and
// Grants, under the broker's serving certificate.
func (b *Broker) exchangeServer() *grpc.Server {
	keepaliveParams := keepalive.ServerParameters{Time: time.Minute, Timeout: 20 * time.Second}
	exchange := b.grpcServer(b.handshakes.limitHandshakes("exchange", credentials.NewTLS(&tls.Config{
		GetCertificate: b.keyPair.GetCertificate,
		MinVersion:     tls.VersionTLS12,
	})), keepaliveParams)
	pb.RegisterTokenExchangeServer(exchange, b.exchange)
	pb.RegisterGrantsServer(exchange, b.grantsAPI)
	if b.cfg.EnableReflection {
		reflection.Register(exchange)
	}
	return exchange
}

// agentServer is the gRPC server of the agent port: the AgentTunnel and the
// API proxy's data path, under the broker's SVID.
func (b *Broker) agentServer() *grpc.Server {
	// Agent connections are renewed now and then, so that each handshake
	// is made again with the SVIDs and the bundle of the day; a stream also
	// ends when the agent's SVID expires (pkg/tunnel).
	// They are pinged soon after they fall silent, so that a partition
	// without a TCP reset ends the stream in AgentKeepaliveTime +
	// AgentKeepaliveTimeout, and its mints in flight move to another stream.
	agentKeepalive := keepalive.ServerParameters{
		Time:                  b.cfg.AgentKeepaliveTime,
		Timeout:               b.cfg.AgentKeepaliveTimeout,
		MaxConnectionAge:      b.cfg.AgentMaxConnectionAge,
		MaxConnectionAgeGrace: b.cfg.AgentMaxConnectionAgeGrace,
	}
	// An agent stream is idle most of the time and carries small frames;
	// a connection's 32 KiB read buffer was most of its memory. TLS reads
	// whole records into a buffer of its own, so the framer reads from it
	// directly. (gRPC already shares write buffers between connections.)
	agents := b.grpcServer(b.handshakes.limitHandshakes("agent", identity.ServerCredentials(b.svid, b.svid, b.cfg.TrustDomain)), agentKeepalive,
		grpc.ReadBufferSize(0))
	pb.RegisterAgentTunnelServer(agents, b.tunnel)
	agentpb.RegisterAgentServiceServer(agents, b.router)
	return agents
}

// serve serves, in g, the exchange and agent ports, the router, the metrics
// and the API proxy, and drains them once ctx ends. The returned func stops
// the router, which otherwise runs until the drain is over.
func (b *Broker) serve(ctx context.Context, g *errgroup.Group, exchange, agents *grpc.Server) (stopRouter func()) {
	serveGRPC := func(name string, s *grpc.Server, lis net.Listener) {
		g.Go(func() error {
			if err := s.Serve(lis); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
				return fmt.Errorf("broker: %s server: %w", name, err)
			}
			return nil
		})
	}
	serveGRPC("exchange", exchange, b.exchangeLis)
	b.startedNow()
	serveGRPC("agent", agents, b.agentLis)
	drained := make(chan struct{})
	// The router's in-memory frontend outlives the drain: the API proxy
	// serves until then.
	routerCtx, stopRouter := context.WithCancel(context.WithoutCancel(ctx))
	go func() {
		<-drained
		stopRouter()
	}()
	g.Go(func() error { return b.router.Run(routerCtx) })
	g.Go(func() error {
		defer close(drained)
		<-ctx.Done()
		b.drain(exchange, agents)
		return nil
	})
	if b.metricsLis != nil {
		g.Go(func() error { return b.serveMetrics(drained) })
	}
	if b.proxyServer != nil {
		g.Go(b.serveProxy)
	}
	return stopRouter
}

func (b *Broker) grpcServer(creds credentials.TransportCredentials, params keepalive.ServerParameters, opts ...grpc.ServerOption) *grpc.Server {
	s := grpc.NewServer(append([]grpc.ServerOption{
		grpc.Creds(creds),
		grpc.KeepaliveParams(params),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 5 * time.Second, PermitWithoutStream: true}),
		grpc.MaxRecvMsgSize(64 << 10),
		grpc.MaxHeaderListSize(64 << 10),
		grpc.MaxConcurrentStreams(b.cfg.MaxConcurrentStreams),
		grpc.ChainUnaryInterceptor(recoverUnary(b.log)),
		grpc.ChainStreamInterceptor(recoverStream(b.log)),
	}, opts...)...)
	healthpb.RegisterHealthServer(s, b.health)
	return s
}

func (b *Broker) serveMetrics(drained <-chan struct{}) error {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(b.registry, promhttp.HandlerOpts{}))
	probe.Serve(mux, b.alive, b.Ready)
	if b.cfg.Profiling {
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		// /readyz answers "draining" until the drain is over.
		<-drained
		sctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	if err := srv.Serve(b.metricsLis); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("broker: metrics server: %w", err)
	}
	return nil
}
