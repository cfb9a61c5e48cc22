package broker

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/pprof"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"golang.org/x/sync/errgroup"
	"golang.org/x/time/rate"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/metadata/metadatainformer"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/clock"
	agentpb "sigs.k8s.io/apiserver-network-proxy/proto/agent"
	inventoryinformers "sigs.k8s.io/cluster-inventory-api/client/informers/externalversions"

	"github.com/credbroker/credbroker/internal/probe"
	"github.com/credbroker/credbroker/pkg/apiproxy"
	"github.com/credbroker/credbroker/pkg/clusterprofile"
	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/grants"
	"github.com/credbroker/credbroker/pkg/hubkeys"
	"github.com/credbroker/credbroker/pkg/identity"
	"github.com/credbroker/credbroker/pkg/publish"
	"github.com/credbroker/credbroker/pkg/tokenexchange"
	"github.com/credbroker/credbroker/pkg/tunnel"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// Broker is the assembled hub side. Build it with New; serve with Run.
type Broker struct {
	cfg Config
	log logr.Logger

	exchangeLis, agentLis, metricsLis net.Listener
	// router carries the agents' data path streams; proxyServer, on
	// proxyLis, is the API proxy, nil unless ProxyAddress is set.
	router      *apiproxy.Router
	proxyServer *http.Server
	proxyLis    net.Listener

	svid      identity.Source
	keyPair   *identity.KeyPairFile
	informers inventoryinformers.SharedInformerFactory
	profiles  *clusterprofile.Index
	// rbacInformers and accountInformers watch what the revocation
	// triggers check: hub RBAC, and hub ServiceAccounts' metadata.
	rbacInformers    informers.SharedInformerFactory
	accountInformers metadatainformer.SharedInformerFactory
	grants           *grants.Registry
	// pending records the revokes no agent confirmed, in a ConfigMap of
	// the hub that pendingInformers watches.
	pending          *grants.PendingStore
	pendingInformers informers.SharedInformerFactory
	grantsAPI        *grants.Service
	triggers         *grants.Triggers
	tunnel           *tunnel.Server
	keys             *hubkeys.Keys
	exchange         *tokenexchange.Service
	// publisher keeps the access provider in ClusterProfiles' status; nil
	// unless PublishAccessProvider. hubClient serves its Lease.
	publisher *publish.Publisher
	hubClient kubernetes.Interface
	health    *health.Server
	registry  *prometheus.Registry
	// draining is set when Run's context ends; the broker is not ready
	// from then on.
	draining atomic.Bool
	// started is when the agent port started serving; arrived is set
	// once the agents have had their chance to find this replica
	// (agentsArrived).
	started atomic.Pointer[time.Time]
	arrived atomic.Bool
}

// New validates cfg, loads the certificates, builds every part and binds the
// listeners. Nothing is served until Run.
func New(cfg Config) (b *Broker, err error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("broker: invalid config: %w", err)
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	b = &Broker{cfg: cfg, log: cfg.Log}
	defer func() {
		if err != nil {
			b.closeListeners()
			if c, ok := b.svid.(io.Closer); ok {
				_ = c.Close()
			}
		}
	}()
	h := &hubClients{}
	for _, step := range []func(*hubClients) error{
		b.newIdentity,
		b.newHubClients,
		b.newProfiles,
		b.newMetrics,
		b.newGrants,
		b.newTunnel,
		b.newPublishing,
		b.newExchange,
		b.newGrantsAPI,
		b.newServing,
	} {
		if err := step(h); err != nil {
			return nil, fmt.Errorf("broker: %w", err)
		}
	}
	return b, nil
}

// ExchangeAddr is the bound address of the TokenExchange listener.
func (b *Broker) ExchangeAddr() string { return b.exchangeLis.Addr().String() }

// AgentAddr is the bound address of the AgentTunnel listener.
func (b *Broker) AgentAddr() string { return b.agentLis.Addr().String() }

// MetricsAddr is the bound address of the /metrics, /healthz and /readyz
// listener; empty when it is disabled.
func (b *Broker) MetricsAddr() string {
	if b.metricsLis == nil {
		return ""
	}
	return b.metricsLis.Addr().String()
}

// Connected reports how many agent streams serve the ClusterProfile.
func (b *Broker) Connected(namespace, name string) int {
	cp, err := b.profiles.Get(namespace, name)
	if err != nil {
		return 0
	}
	return b.tunnel.Connected(fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: namespace, Name: name}, UID: cp.UID})
}

// PendingAgentRequests reports how many mints and revokes wait for an
// agent's answer.
func (b *Broker) PendingAgentRequests() int { return b.tunnel.Pending() }

// Grants is the broker's registry of the live grants its agents report, and
// of the tokens it revoked.
func (b *Broker) Grants() *grants.Registry { return b.grants }

// tunnelRevoker revokes through the broker's tunnel server, which is built
// after the registry it feeds.
type tunnelRevoker struct{ b *Broker }

func (r tunnelRevoker) Revoke(ctx context.Context, cluster fleet.ClusterRef, ids []string, reason string) ([]string, error) {
	return r.b.tunnel.Revoke(ctx, cluster, ids, reason)
}

func (b *Broker) closeListeners() {
	for _, l := range []net.Listener{b.exchangeLis, b.agentLis, b.metricsLis, b.proxyLis} {
		if l != nil {
			_ = l.Close()
		}
	}
}

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

	b.informers.Start(ctx.Done())
	defer b.informers.Shutdown()
	b.rbacInformers.Start(ctx.Done())
	defer b.rbacInformers.Shutdown()
	b.accountInformers.Start(ctx.Done())
	defer b.accountInformers.Shutdown()
	b.pendingInformers.Start(ctx.Done())
	defer b.pendingInformers.Shutdown()
	g.Go(func() error { return b.pending.Run(ctx) })
	g.Go(func() error { return b.triggers.Run(ctx) })
	syncCtx, cancelSync := context.WithTimeout(ctx, b.cfg.CacheSyncTimeout)
	// Agents are served only once the revokes that other replicas recorded
	// are known, to be sent again when the agents connect.
	synced := cache.WaitForCacheSync(syncCtx.Done(), b.profiles.HasSynced, b.pending.HasSynced)
	cancelSync()
	if !synced {
		stopped := ctx.Err() != nil // by the caller, or by a failing part
		cancel()
		if err := g.Wait(); err != nil || stopped {
			return err
		}
		return fmt.Errorf("broker: the ClusterProfile and pending revokes informers did not sync within %s; check the hub connection, that the ClusterProfile CRD is installed, "+
			"and that the broker may list and watch ConfigMap %s/%s (deploy/hub/rbac.yaml)", b.cfg.CacheSyncTimeout, b.cfg.PendingRevokesNamespace, grants.DefaultPendingConfigMap)
	}

	if b.publisher != nil {
		g.Go(func() error { return b.runPublisher(ctx, b.hubClient) })
	}

	keepaliveParams := keepalive.ServerParameters{Time: time.Minute, Timeout: 20 * time.Second}
	exchange := b.grpcServer(credentials.NewTLS(&tls.Config{
		GetCertificate: b.keyPair.GetCertificate,
		MinVersion:     tls.VersionTLS12,
	}), keepaliveParams)
	pb.RegisterTokenExchangeServer(exchange, b.exchange)
	pb.RegisterGrantsServer(exchange, b.grantsAPI)
	if b.cfg.EnableReflection {
		reflection.Register(exchange)
	}

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
	// directly.
	agents := b.grpcServer(identity.ServerCredentials(b.svid, b.svid, b.cfg.TrustDomain), agentKeepalive, grpc.ReadBufferSize(0))
	pb.RegisterAgentTunnelServer(agents, b.tunnel)
	agentpb.RegisterAgentServiceServer(agents, b.router)

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
	defer stopRouter()
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

	b.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	b.log.Info("broker serving", "exchange", b.ExchangeAddr(), "agents", b.AgentAddr(), "trustDomain", b.cfg.TrustDomain.String())
	err := g.Wait()
	b.health.Shutdown()
	return err
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

// Ready reports nil when the broker is ready to serve, or why not: the
// ClusterProfile informer has synced, the hub issuer's keys are loaded, its
// SVID is valid for more than probe.MinSVIDLifetime (a quarter of its
// lifetime, if that is less), the agents have had their chance to find it
// (agentsArrived), and it is not draining. /readyz answers it.
func (b *Broker) Ready() error {
	return probe.All(
		probe.Synced("the ClusterProfile informer has not synced", b.profiles.HasSynced),
		probe.Synced("the hub issuer's keys are not loaded", b.keys.Loaded),
		probe.SVIDValid(b.svid, b.cfg.Clock, probe.MinSVIDLifetime),
		b.agentsArrived,
		probe.NotDraining(&b.draining),
	)()
}

// alive answers /healthz. It takes the tunnel's session lock, which every
// mint needs: a broker wedged there times the probe out and is restarted.
func (b *Broker) alive() error {
	b.tunnel.Connected(fleet.ClusterRef{})
	return nil
}

// drain stops the broker within ShutdownGrace: not ready and NOT_SERVING on
// both gRPC ports at once, agents told; new calls are still served for
// ShutdownDelay, then refused (a consumer retries another replica) while
// the exchanges in flight finish with their mints; then the agent streams
// close.
func (b *Broker) drain(exchange, agents *grpc.Server) {
	start := time.Now()
	deadline := start.Add(b.cfg.ShutdownGrace)
	b.draining.Store(true)
	b.health.Shutdown()
	b.tunnel.Drain()
	b.log.Info("broker draining", "grace", b.cfg.ShutdownGrace.String(), "delay", b.cfg.ShutdownDelay.String())
	time.Sleep(b.cfg.ShutdownDelay)
	if b.proxyServer != nil {
		// Before the agent streams close: a consumer's next request goes
		// to another replica, not to one that has no agent left. Watches
		// and upgraded connections are cut after half the time left.
		b.stopProxy(time.Until(deadline) / 2)
	}
	stopGracefully(exchange, time.Until(deadline))
	b.tunnel.Close()
	stopGracefully(agents, time.Until(deadline))
	b.log.Info("broker drained", "took", time.Since(start).Round(time.Millisecond).String())
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

// stopGracefully lets in-flight calls finish for up to grace, then stops
// hard.
func stopGracefully(s *grpc.Server, grace time.Duration) {
	done := make(chan struct{})
	go func() {
		s.GracefulStop()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(grace):
		s.Stop()
	}
}

// newIssuerKeys returns the hub issuer's key set, from cfg.IssuerJWKSFile,
// which must load now and is read again every FileCheckInterval, or else
// from the hub's /openid/v1/jwks, fetched first by Run or the first
// exchange.
func newIssuerKeys(cfg Config, hub kubernetes.Interface, reg prometheus.Registerer) (*hubkeys.Keys, error) {
	kc := hubkeys.Config{
		Fetcher:            hubkeys.FromHub(hub.CoreV1().RESTClient()),
		Audience:           cfg.Audience,
		RefreshInterval:    cfg.IssuerKeysRefresh,
		MinRefreshInterval: cfg.IssuerKeysMinRefresh,
		Log:                cfg.Log.WithName("hubkeys"),
		Registerer:         reg,
	}
	if cfg.IssuerJWKSFile == "" {
		return hubkeys.New(kc)
	}
	kc.Fetcher = hubkeys.FromFile(cfg.IssuerJWKSFile)
	if cfg.FileCheckInterval > 0 {
		kc.RefreshInterval = cfg.FileCheckInterval
	}
	kc.MinRefreshInterval = min(kc.MinRefreshInterval, kc.RefreshInterval)
	keys, err := hubkeys.New(kc)
	if err != nil {
		return nil, err
	}
	if err := keys.Load(context.Background()); err != nil {
		return nil, fmt.Errorf("issuer keys in %s: %w", cfg.IssuerJWKSFile, err)
	}
	return keys, nil
}

// newTriggers builds the revocation triggers over b's Registry and
// ClusterProfile index, with informers of hub RBAC and of hub
// ServiceAccounts' metadata (not the whole objects, to keep memory small).
func newTriggers(cfg Config, hub *rest.Config, hubClient kubernetes.Interface, reviews grants.AccessReviewer, b *Broker) (*grants.Triggers, error) {
	b.rbacInformers = informers.NewSharedInformerFactory(hubClient, cfg.InformerResync)
	rbac := b.rbacInformers.Rbac().V1()
	metaClient, err := metadata.NewForConfig(hub)
	if err != nil {
		return nil, fmt.Errorf("hub metadata client: %w", err)
	}
	b.accountInformers = metadatainformer.NewSharedInformerFactory(metaClient, cfg.InformerResync)
	accounts := b.accountInformers.ForResource(corev1.SchemeGroupVersion.WithResource("serviceaccounts")).Informer()
	// Only the name and UID matter.
	if err := accounts.SetTransform(func(obj any) (any, error) {
		if m, err := meta.Accessor(obj); err == nil {
			m.SetManagedFields(nil)
			m.SetAnnotations(nil)
			m.SetLabels(nil)
		}
		return obj, nil
	}); err != nil {
		return nil, fmt.Errorf("hub ServiceAccount informer: %w", err)
	}
	return grants.NewTriggers(grants.TriggersConfig{
		Grants:          b.grants,
		AccessReviews:   reviews,
		ClusterProfiles: b.profiles,
		RBAC: []grants.Informer{
			rbac.Roles().Informer(), rbac.RoleBindings().Informer(),
			rbac.ClusterRoles().Informer(), rbac.ClusterRoleBindings().Informer(),
		},
		ServiceAccounts: accounts,
		Debounce:        cfg.RBACDebounce,
		MaxDelay:        cfg.RBACDebounceMax,
		Interval:        cfg.GrantRecheckInterval,
		ReviewRate:      rate.Limit(cfg.GrantReviewRateLimit),
		ReviewBurst:     cfg.GrantReviewBurst,
		RevokeTimeout:   cfg.MintTimeout,
		Log:             cfg.Log.WithName("triggers"),
	})
}

// agentResolver admits agents through the ClusterProfile index.
type agentResolver struct{ profiles *clusterprofile.Index }

func (r agentResolver) ResolveAgent(id spiffeid.ID) (fleet.ClusterRef, error) {
	cp, err := r.profiles.ForAgent(id)
	if err != nil {
		return fleet.ClusterRef{}, err
	}
	return fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: cp.Namespace, Name: cp.Name}, UID: cp.UID}, nil
}

// clusterLookup answers the exchange's ClusterProfile lookups.
type clusterLookup struct {
	profiles *clusterprofile.Index
	provider string
}

func (c clusterLookup) Cluster(namespace, name string) (tokenexchange.Cluster, error) {
	cp, err := c.profiles.Shared(namespace, name) // read here, never kept
	if err != nil {
		return tokenexchange.Cluster{}, err
	}
	if err := c.profiles.CheckAgent(cp); err != nil {
		return tokenexchange.Cluster{}, err
	}
	server, ca, ok := clusterprofile.Access(cp, c.provider)
	if !ok {
		// Never answer an empty server: the plugin checks that the token
		// goes to this cluster's server, and could not check against none.
		return tokenexchange.Cluster{}, fmt.Errorf("ClusterProfile %s/%s has no server: neither its access provider %q nor any other "+
			"in its status has a cluster.server; its cluster manager must set status.accessProviders[name=%s].cluster.server: %w",
			namespace, name, c.provider, c.provider, errdefs.ErrFailedPrecondition)
	}
	if err := checkHTTPS(namespace, name, c.provider, server); err != nil {
		return tokenexchange.Cluster{}, err
	}
	return tokenexchange.Cluster{
		Ref:    fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: namespace, Name: name}, UID: cp.UID},
		Server: server,
		CAData: ca,
	}, nil
}

// newPendingStore returns the store of the revokes no agent confirmed: the
// ConfigMap grants.DefaultPendingConfigMap in cfg.PendingRevokesNamespace,
// watched alone (a field selector on its name, which RBAC's resourceNames
// can then narrow) by b.pendingInformers.
func newPendingStore(cfg Config, hubClient kubernetes.Interface, b *Broker) (*grants.PendingStore, error) {
	b.pendingInformers = informers.NewSharedInformerFactoryWithOptions(hubClient, cfg.InformerResync,
		informers.WithNamespace(cfg.PendingRevokesNamespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", grants.DefaultPendingConfigMap).String()
		}))
	return grants.NewPendingStore(grants.PendingStoreConfig{
		ConfigMaps:  hubClient.CoreV1().ConfigMaps(cfg.PendingRevokesNamespace),
		Namespace:   cfg.PendingRevokesNamespace,
		Informer:    b.pendingInformers.Core().V1().ConfigMaps().Informer(),
		MaxLifetime: cfg.MaxExpiration,
		Log:         cfg.Log.WithName("pending-revokes"),
	})
}
