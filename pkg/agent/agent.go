package agent

import (
	"cmp"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/url"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"golang.org/x/sync/errgroup"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/informers"
	corev1listers "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/pkg/identity"
	"github.com/credbroker/credbroker/pkg/spoke"
	"github.com/credbroker/credbroker/pkg/token"
	"github.com/credbroker/credbroker/pkg/tunnel"
)

// The Minter answers the brokers' revoke requests and reports the grants.
var _ tunnel.Grants = (*spoke.Minter)(nil)

// Version is reported to the broker in the agent's hello.
var Version = "dev"

// Config is the agent's validated configuration.
type Config struct {
	// BrokerAddresses are the broker targets, host:port each. A DNS name is
	// resolved every ResolveInterval and the agent holds one stream to every
	// address it resolves to: point it at the broker's headless Service and
	// every replica can reach the agent.
	BrokerAddresses []string
	ResolveInterval time.Duration
	// BrokerID is the SPIFFE ID the broker must present.
	BrokerID spiffeid.ID
	// Cluster, when set, is the ClusterProfile on the hub that this agent
	// serves. A broker that admits the agent for any other ClusterProfile
	// has its stream closed and retried with backoff. Empty: serve whichever
	// ClusterProfile the broker maps the agent's SPIFFE ID to.
	Cluster types.NamespacedName
	// Config is the agent's SPIFFE identity: its X.509-SVID and the bundle
	// of TrustDomain, from files or the Workload API. A zero SPIFFEID means
	// the default ID of Cluster, spiffe://<TrustDomain>/clusterprofile/<ns>/<name>,
	// when Cluster is set, and else the first SVID in TrustDomain.
	identity.Config

	// Spoke is the spoke API server's client config; the agent needs
	// create on serviceaccounts/token, list/watch on serviceaccounts,
	// create, patch, delete, list and watch on secrets for its grants, and
	// create on subjectaccessreviews to refuse escalating ServiceAccounts.
	Spoke *rest.Config
	// SpokeQPS and SpokeBurst bound the agent's requests to the spoke API
	// server, for each of its clients (TokenRequests, escalation reviews,
	// the rest). client-go's defaults (5 and 10) would throttle the agent:
	// every mint costs three requests (create the grant, TokenRequest,
	// patch the grant), and a revoke one delete per grant.
	SpokeQPS   float32
	SpokeBurst int
	// AdvertiseServer and AdvertiseCAData, when set, are the spoke API
	// server's URL as the hub reaches it and the PEM bundle that verifies
	// it. The agent sends them in its hello; a broker that publishes its
	// access provider writes them into the ClusterProfile's status. The
	// agent never guesses them: the in-cluster URL is not the hub's.
	AdvertiseServer string
	AdvertiseCAData []byte
	// DataPath offers the spoke API server to the brokers' API proxy: the
	// agent keeps a konnectivity stream to every broker address beside its
	// AgentTunnel stream, and connects the brokers' dials to Spoke's host,
	// whose server name and CA it sends in its hello (package apiproxy).
	// For a spoke the hub cannot reach. Spoke must then name its CA.
	DataPath bool
	// Namespace limits the ServiceAccounts the agent may mint for, and the
	// grants it watches; empty means all namespaces.
	Namespace string
	// AllowEscalatingServiceAccounts are the ServiceAccounts, as
	// namespace/name or namespace/* for every one of a namespace, that the
	// agent mints for even though they may create ServiceAccount tokens or
	// impersonate (spoke.Config.AllowEscalating). Empty: none. Only the
	// spoke admin who runs the agent sets it.
	AllowEscalatingServiceAccounts []types.NamespacedName
	// MaxExpiration caps minted tokens' lifetime.
	MaxExpiration time.Duration
	// MintTimeout bounds one TokenRequest. Keep it at least the broker's
	// mint timeout, which bounds how long the broker waits for the answer.
	MintTimeout time.Duration
	// CollectInterval is how often the agent looks through its grants (in
	// its informer's cache) to delete those whose token has expired,
	// including those left by an agent that stopped before it could. Zero
	// means spoke.DefaultCollectInterval. No grant outlives its token by
	// more than this while an agent runs.
	CollectInterval time.Duration
	// GrantPoolSize is how many grant Secrets the agent keeps ready for
	// each ServiceAccount it has minted for, so that a mint's answer waits
	// for its TokenRequest only (spoke.Config.PoolSize); zero creates each
	// grant on the mint's path.
	GrantPoolSize int
	// Clock times grant expiry, the spoke health probes and the SVID
	// validity that readiness checks; nil means the real clock.
	Clock clock.WithTickerAndDelayedExecution

	// SpokeHealthInterval is how often the agent asks the spoke API
	// server's /readyz, to report to the brokers, which may keep the
	// ClusterProfile's ControlPlaneHealthy condition from it; zero turns
	// the probes and the reports off. SpokeHealthFailureThreshold is how
	// many failures in a row make the agent report the spoke not ready.
	SpokeHealthInterval         time.Duration
	SpokeHealthFailureThreshold int

	// InitialBackoff and MaxBackoff bound reconnect waits.
	InitialBackoff, MaxBackoff time.Duration
	CacheSyncTimeout           time.Duration

	// MetricsAddress serves /metrics, /healthz and /readyz over HTTP; empty
	// disables it. The agent is ready while at least one broker stream
	// serves and its SVID is valid.
	MetricsAddress string
	// ShutdownGrace bounds the drain when Run's context ends: every stream
	// says goodbye, answers its requests in flight, and closes.
	ShutdownGrace time.Duration
	// MaxInFlight bounds the concurrent mints and revokes of one broker
	// stream.
	MaxInFlight int
	// KeepaliveTime is how long a broker connection may be silent before
	// the agent pings the broker, and KeepaliveTimeout how long it then
	// waits for the answer before it reconnects: their sum bounds how long
	// a partition without a TCP reset goes unnoticed. gRPC raises a client's
	// keepalive time under 10s to 10s, so Validate refuses less.
	KeepaliveTime, KeepaliveTimeout time.Duration

	Log logr.Logger
}

// Default returns a Config with every default set.
func Default() Config {
	return Config{
		Config:           identity.DefaultConfig(),
		MaxExpiration:    spoke.DefaultMaxExpiration,
		SpokeQPS:         50,
		SpokeBurst:       100,
		ResolveInterval:  30 * time.Second,
		MintTimeout:      30 * time.Second,
		CollectInterval:  spoke.DefaultCollectInterval,
		GrantPoolSize:    spoke.DefaultPoolSize,
		InitialBackoff:   tunnel.DefaultInitialBackoff,
		MaxBackoff:       tunnel.DefaultMaxBackoff,
		CacheSyncTimeout: time.Minute,
		MetricsAddress:   ":8080",
		ShutdownGrace:    15 * time.Second,
		MaxInFlight:      tunnel.DefaultMaxInFlight,
		KeepaliveTime:    tunnel.DefaultKeepalive,
		KeepaliveTimeout: tunnel.DefaultKeepaliveTimeout,

		SpokeHealthInterval:         10 * time.Second,
		SpokeHealthFailureThreshold: 3,
	}
}

// Validate reports every missing or inconsistent field at once.
func (c *Config) Validate() error {
	var errs []error
	need := func(ok bool, format string, args ...any) {
		if !ok {
			errs = append(errs, fmt.Errorf(format, args...))
		}
	}
	need(len(c.BrokerAddresses) > 0, "at least one broker address is required")
	for _, addr := range c.BrokerAddresses {
		_, _, err := net.SplitHostPort(addr)
		need(err == nil, "broker address %q is not host:port", addr)
	}
	need(c.ResolveInterval > 0, "the resolve interval must be positive")
	if c.AdvertiseServer != "" {
		u, err := url.Parse(c.AdvertiseServer)
		need(err == nil && u.Scheme == "https" && u.Host != "", "the advertised server %q is not an https URL", c.AdvertiseServer)
	}
	if len(c.AdvertiseCAData) > 0 {
		pool := x509.NewCertPool()
		need(c.AdvertiseServer != "", "an advertised CA needs an advertised server")
		need(pool.AppendCertsFromPEM(c.AdvertiseCAData), "the advertised CA holds no PEM certificate")
	}
	if c.DataPath && c.Spoke != nil {
		if _, err := dataPathOf(c.Spoke); err != nil {
			errs = append(errs, err)
		}
	}
	need(c.MintTimeout > 0, "the mint timeout must be positive")
	need(c.ShutdownGrace > 0, "the shutdown grace must be positive")
	need(c.MaxInFlight > 0, "the in-flight requests per stream must be positive")
	need(c.KeepaliveTime >= 10*time.Second, "the keepalive time (%s) must be at least 10s, gRPC's floor for clients", c.KeepaliveTime)
	need(c.KeepaliveTimeout >= time.Second, "the keepalive timeout (%s) must be at least 1s", c.KeepaliveTimeout)
	need(c.CollectInterval >= 0, "the grant collect interval must not be negative")
	need(c.GrantPoolSize >= 0, "the grant pool size must not be negative")
	need(c.SpokeHealthInterval >= 0, "the spoke health interval must not be negative")
	need(c.SpokeHealthInterval == 0 || c.SpokeHealthFailureThreshold > 0, "the spoke health failure threshold must be positive")
	errs = append(errs, c.Config.Validate("agent"))
	need(!c.BrokerID.IsZero() && c.BrokerID.MemberOf(c.TrustDomain), "the broker SPIFFE ID must be in trust domain %q", c.TrustDomain)
	need(c.Spoke != nil, "a spoke client config is required")
	need(c.SpokeQPS > 0 && !math.IsInf(float64(c.SpokeQPS), 0) && !math.IsNaN(float64(c.SpokeQPS)) && c.SpokeBurst > 0,
		"the spoke QPS and burst must be positive and finite")
	if c.Cluster != (types.NamespacedName{}) {
		need(len(validation.IsDNS1123Label(c.Cluster.Namespace)) == 0 && len(validation.IsDNS1123Subdomain(c.Cluster.Name)) == 0,
			"the cluster %q is not a ClusterProfile namespace/name", c.Cluster)
	}
	need(c.MaxExpiration >= token.MinExpiration, "the maximum expiration must be at least 10m (TokenRequest's floor), got %s", c.MaxExpiration)
	for _, n := range c.AllowEscalatingServiceAccounts {
		if _, err := spoke.ParseAllowEscalating(n.Namespace + "/" + n.Name); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Agent is the assembled spoke side.
type Agent struct {
	cfg Config
	// instance names this agent process on every broker stream, so that
	// every broker replica ranks it alike for a namespace's mints.
	instance  string
	svid      identity.Source
	informers informers.SharedInformerFactory
	grants    cache.SharedIndexInformer
	synced    []cache.InformerSynced
	sas       corev1listers.ServiceAccountLister
	targets   []*fanout
	minter    *spoke.Minter
	clock     clock.WithTicker
	// spoke is the spoke client that probes /readyz; health holds what it
	// saw, for the broker streams. Both nil when the probes are off.
	spoke  rest.Interface
	health *tunnel.SpokeHealth
	// connected is closed once every target has admitted a stream;
	// unconnected counts the targets that have not yet.
	connected   chan struct{}
	unconnected atomic.Int64

	mu      sync.Mutex
	clients map[*tunnel.Client]struct{} // the running broker streams' clients

	metricsLis net.Listener
	registry   *prometheus.Registry
	metrics    *agentMetrics
	// serving counts the broker streams that serve: admitted, and neither
	// draining nor leaving.
	serving atomic.Int64
}

// New validates cfg and builds every part; nothing connects until Run.
func New(cfg Config) (_ *Agent, err error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("agent: invalid config: %w", err)
	}
	a := &Agent{cfg: cfg, clock: clock.RealClock{}, instance: tunnel.NewInstance()}
	if cfg.Clock != nil {
		a.clock = cfg.Clock
	}
	defer func() {
		if err != nil {
			if c, ok := a.svid.(io.Closer); ok {
				_ = c.Close()
			}
		}
	}()
	p := &parts{}
	for _, step := range []func(*parts) error{
		a.newIdentity,
		a.newMetrics,
		a.newSpokeClients,
		a.newInformers,
		a.newMinter,
		a.newHello,
		a.newTargets,
		a.newListener,
	} {
		if err := step(p); err != nil {
			return nil, fmt.Errorf("agent: %w", err)
		}
	}
	return a, nil
}

func clusterString(c types.NamespacedName) string {
	if c == (types.NamespacedName{}) {
		return ""
	}
	return c.String()
}

// addTarget adds a broker target, which Connected waits for. Call it only
// while building the agent.
func (a *Agent) addTarget(f *fanout) {
	if a.connected == nil {
		a.connected = make(chan struct{})
	}
	a.unconnected.Add(1)
	f.onConnected = func() {
		if a.unconnected.Add(-1) == 0 {
			close(a.connected)
		}
	}
	a.targets = append(a.targets, f)
}

// Connected is closed once every broker target has admitted a stream. It
// starts no goroutine: an agent whose target never connects leaks nothing.
func (a *Agent) Connected() <-chan struct{} { return a.connected }

// ServiceAccounts is the agent's view of the spoke's ServiceAccounts, from
// which it applies the opt-in policy. Its cache trails the API server by the
// informer's watch latency.
func (a *Agent) ServiceAccounts() corev1listers.ServiceAccountLister { return a.sas }

// Run syncs the ServiceAccount and grant informers, then collects grants and
// holds the broker streams until ctx ends. The first part that fails stops
// the others.
func (a *Agent) Run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return a.svid.Run(ctx) })
	if a.health != nil {
		g.Go(func() error { return a.probeSpoke(ctx, a.spoke, a.health) })
	}
	if a.metricsLis != nil {
		// Served from the start, so that /healthz answers while the
		// informers sync; closed last, after the streams' goodbyes.
		defer a.serveMetrics()()
	}

	a.informers.Start(ctx.Done())
	defer a.informers.Shutdown()
	grantsDone := make(chan struct{})
	go func() {
		defer close(grantsDone)
		a.grants.RunWithContext(ctx)
	}()
	defer func() { <-grantsDone }()
	defer cancel() // runs first: stops the grant informer
	syncCtx, cancelSync := context.WithTimeout(ctx, a.cfg.CacheSyncTimeout)
	synced := cache.WaitForCacheSync(syncCtx.Done(), a.synced...)
	cancelSync()
	if !synced {
		stopped := ctx.Err() != nil // by the caller, or by a failing part
		cancel()
		if err := g.Wait(); err != nil || stopped {
			return err
		}
		return fmt.Errorf("agent: the ServiceAccount and grant informers did not sync within %s; check the spoke connection and the agent's RBAC (list and watch on serviceaccounts and secrets)", a.cfg.CacheSyncTimeout)
	}
	g.Go(func() error { return a.minter.Run(ctx) })
	for _, t := range a.targets {
		g.Go(func() error { return t.Run(ctx) })
	}
	a.cfg.Log.Info("agent running", "brokers", a.cfg.BrokerAddresses, "namespace", a.cfg.Namespace)
	return g.Wait()
}

// CheckDataPath reports why the data path cannot be offered with the spoke
// client config spoke, or nil: it needs an https host and a CA.
func CheckDataPath(spoke *rest.Config) error {
	_, err := dataPathOf(spoke)
	return err
}

// dataPath is how the brokers reach the spoke API server through the
// agent: the address the agent dials, and the name and CA that verify it.
type dataPath struct {
	address, serverName string
	caData              []byte
}

// dataPathOf derives the data path from the agent's spoke client config:
// its https host (port 443 by default), its TLS server name or else the
// host's name, and its CA, which must be set.
func dataPathOf(spoke *rest.Config) (dataPath, error) {
	u, err := url.Parse(spoke.Host)
	if err != nil || u.Scheme != "https" || u.Hostname() == "" {
		return dataPath{}, fmt.Errorf("the data path needs the spoke API server's https URL, got %q", spoke.Host)
	}
	port := u.Port()
	if port == "" {
		port = "443"
	}
	dp := dataPath{address: net.JoinHostPort(u.Hostname(), port), serverName: cmp.Or(spoke.TLSClientConfig.ServerName, u.Hostname())}
	switch {
	case len(spoke.TLSClientConfig.CAData) > 0:
		dp.caData = spoke.TLSClientConfig.CAData
	case spoke.TLSClientConfig.CAFile != "":
		if dp.caData, err = os.ReadFile(spoke.TLSClientConfig.CAFile); err != nil {
			return dataPath{}, fmt.Errorf("the data path needs the spoke API server's CA: %w", err)
		}
	}
	if !x509.NewCertPool().AppendCertsFromPEM(dp.caData) {
		return dataPath{}, errors.New("the data path needs the spoke API server's CA in the spoke client config (certificate-authority), to send to the brokers")
	}
	return dp, nil
}
