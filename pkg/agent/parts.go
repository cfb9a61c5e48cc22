package agent

import (
	"context"
	"fmt"
	"net"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc/credentials"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	corev1informers "k8s.io/client-go/informers/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/credbroker/credbroker/pkg/apiproxy"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/identity"
	"github.com/credbroker/credbroker/pkg/spoke"
	"github.com/credbroker/credbroker/pkg/tunnel"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// The steps of New: each builds one part of the Agent, in this file's
// order, and returns an error that New wraps with "agent: ".

// parts holds what New's steps hand on to later steps; the Agent keeps
// none of it.
type parts struct {
	// client is the spoke client; tokens and reviews, of the same config,
	// have client-side budgets of their own for the TokenRequests and the
	// escalation reviews.
	client, tokens, reviews *kubernetes.Clientset
	serviceAccounts         corev1informers.ServiceAccountInformer
	// creds, hello and backend serve every broker stream: the agent's
	// SPIFFE mTLS, what it tells the brokers, and its data path, nil
	// unless DataPath.
	creds   credentials.TransportCredentials
	hello   *pb.Hello
	backend *apiproxy.Backend
}

// newIdentity loads the agent's SVID source: the SVID of SPIFFEID, else of
// Cluster's default ID when Cluster is set, else the first of TrustDomain.
func (a *Agent) newIdentity(*parts) (err error) {
	cfg := a.cfg
	var id spiffeid.ID
	if cfg.SPIFFEID.IsZero() && cfg.Cluster != (types.NamespacedName{}) {
		if id, err = fleet.AgentID(cfg.TrustDomain, cfg.Cluster); err != nil {
			return err
		}
	}
	a.svid, err = cfg.NewSource(context.Background(), id, cfg.Log.WithName("svid"))
	return err
}

// newMetrics builds the agent's registry and metrics.
func (a *Agent) newMetrics(*parts) (err error) {
	a.registry, a.metrics, err = newAgentRegistry(a.svid, a.cfg.BrokerAddresses)
	return err
}

// newSpokeClients builds the spoke clients, with SpokeQPS and SpokeBurst,
// and the spoke health probe's client when SpokeHealthInterval is set.
func (a *Agent) newSpokeClients(p *parts) (err error) {
	spokeConfig := rest.CopyConfig(a.cfg.Spoke)
	spokeConfig.UserAgent = "credbroker-spoke-agent/" + Version
	spokeConfig.QPS, spokeConfig.Burst = a.cfg.SpokeQPS, a.cfg.SpokeBurst
	if p.client, err = kubernetes.NewForConfig(spokeConfig); err != nil {
		return fmt.Errorf("spoke client: %w", err)
	}
	// The TokenRequests, the only spoke requests on a pooled mint's answer
	// path, and the escalation reviews have client-side budgets of their
	// own: a new ServiceAccount costs four reviews, and a mint two grant
	// writes besides its TokenRequest, and none should wait on the others.
	if p.tokens, err = kubernetes.NewForConfig(spokeConfig); err != nil {
		return fmt.Errorf("spoke client: %w", err)
	}
	if p.reviews, err = kubernetes.NewForConfig(spokeConfig); err != nil {
		return fmt.Errorf("spoke client: %w", err)
	}
	if a.cfg.SpokeHealthInterval > 0 {
		a.spoke, a.health = p.client.Discovery().RESTClient(), tunnel.NewSpokeHealth()
	}
	return nil
}

// newInformers builds the informers of the ServiceAccounts, in Namespace
// when set, and of the grants.
func (a *Agent) newInformers(p *parts) error {
	a.informers = informers.NewSharedInformerFactoryWithOptions(p.client, 0, informers.WithNamespace(a.cfg.Namespace))
	p.serviceAccounts = a.informers.Core().V1().ServiceAccounts()
	a.sas = p.serviceAccounts.Lister()
	// The agent reads its grants from a watch: restart collection,
	// revocation by credential id and the hello's snapshot cost no list.
	a.grants = spoke.NewGrantInformer(p.client, a.cfg.Namespace)
	a.synced = []cache.InformerSynced{p.serviceAccounts.Informer().HasSynced, a.grants.HasSynced}
	return nil
}

// newMinter builds the Minter and hooks it to the grant and ServiceAccount
// informers.
func (a *Agent) newMinter(p *parts) error {
	cfg := a.cfg
	minter, err := spoke.New(spoke.Config{
		Tokens:          countedTokens{spoke.NewTokenCreator(p.tokens), a.metrics},
		ServiceAccounts: p.serviceAccounts.Lister(),
		Grants:          spoke.NewGrantStore(p.client, cfg.Namespace),
		GrantCache:      a.grants.GetIndexer(),
		CollectInterval: cfg.CollectInterval,
		PoolSize:        cfg.GrantPoolSize,
		MaxExpiration:   cfg.MaxExpiration,
		Access:          spoke.NewAccessReviewer(p.reviews),
		AllowEscalating: cfg.AllowEscalatingServiceAccounts,
		Clock:           cfg.Clock,
		Log:             cfg.Log.WithName("mint"),
	})
	if err != nil {
		return err
	}
	if _, err := a.grants.AddEventHandler(minter.GrantEvents()); err != nil {
		return fmt.Errorf("watch grants: %w", err)
	}

	a.minter = minter
	// Withdrawing an opt-in or an audience revokes the grants it allowed.
	if _, err := p.serviceAccounts.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		UpdateFunc: func(old, now any) {
			o, ok1 := old.(*corev1.ServiceAccount)
			n, ok2 := now.(*corev1.ServiceAccount)
			if ok1 && ok2 {
				minter.PolicyChanged(o, n)
			}
		},
	}); err != nil {
		return fmt.Errorf("watch ServiceAccount policy: %w", err)
	}
	return nil
}

// newHello builds what every broker stream shares: the agent's transport
// credentials, its hello, and with DataPath the backend of its data path,
// which the hello offers.
func (a *Agent) newHello(p *parts) error {
	cfg := a.cfg
	p.creds = identity.ClientCredentials(a.svid, a.svid, cfg.BrokerID)
	p.hello = &pb.Hello{AgentVersion: Version, Server: cfg.AdvertiseServer, CertificateAuthorityData: cfg.AdvertiseCAData}
	if !cfg.DataPath {
		return nil
	}
	dp, err := dataPathOf(cfg.Spoke)
	if err != nil {
		return err
	}
	p.hello.DataPath = &pb.DataPath{ServerName: dp.serverName, CertificateAuthorityData: dp.caData}
	p.backend, err = apiproxy.NewBackend(apiproxy.BackendConfig{
		Credentials: p.creds, APIServer: dp.address, AgentID: cfg.SPIFFEID.String(), Log: cfg.Log.WithName("datapath"),
	})
	return err
}

// newTargets builds a fanout for every broker target, which holds a stream
// to every address the target resolves to, and renews the streams when the
// SVID rotates.
func (a *Agent) newTargets(p *parts) error {
	cfg := a.cfg
	fanouts := map[string]*fanout{} // by target, filled below
	a.clients = map[*tunnel.Client]struct{}{}
	// A rotated SVID gets a stream of its own to every broker before the
	// streams of the old one drain: the old streams end at its NotAfter.
	identity.SVIDChanges(a.svid, func(svid *x509svid.SVID) {
		cfg.Log.Info("SVID rotated; renewing the broker streams", "id", svid.ID.String(), "expires", svid.Certificates[0].NotAfter)
		a.mu.Lock()
		defer a.mu.Unlock()
		for c := range a.clients {
			c.Rotate()
		}
	})
	for _, target := range cfg.BrokerAddresses {
		f := newFanout(target, cfg.ResolveInterval, net.DefaultResolver.LookupHost, func(ctx context.Context, addr string, connected func()) error {
			return a.serve(ctx, a.clientConfig(p, target, addr, fanouts[target].resolveSoon), p.backend, connected)
		}, cfg.Log.WithName("brokers"))
		f.onStreams = a.metrics.targetAddresses.WithLabelValues(target).Set
		fanouts[target] = f
		a.addTarget(f)
	}
	return nil
}

// clientConfig configures the stream to addr, an address of the broker
// target; onBrokerDrain asks the target's fanout to resolve it again soon.
func (a *Agent) clientConfig(p *parts, target, addr string, onBrokerDrain func()) tunnel.ClientConfig {
	cfg := a.cfg
	return tunnel.ClientConfig{
		Address:          addr,
		Instance:         a.instance,
		Credentials:      p.creds,
		Minter:           instrumented{a.minter, a.metrics},
		Grants:           a.minter,
		Hello:            p.hello,
		SpokeHealth:      a.health,
		Cluster:          clusterString(cfg.Cluster),
		MintTimeout:      cfg.MintTimeout,
		MaxInFlight:      cfg.MaxInFlight,
		Keepalive:        cfg.KeepaliveTime,
		KeepaliveTimeout: cfg.KeepaliveTimeout,
		DrainTimeout:     cfg.ShutdownGrace,
		Serving:          func(up bool) { a.countServing(target, up) },
		OnBrokerDrain:    onBrokerDrain,
		InitialBackoff:   cfg.InitialBackoff,
		MaxBackoff:       cfg.MaxBackoff,
		Log:              cfg.Log.WithName("tunnel"),
	}
}

// serve holds one broker stream of config c, and the data path to the same
// address through backend when it is not nil, until ctx ends; connected is
// called once the broker admits the stream.
func (a *Agent) serve(ctx context.Context, c tunnel.ClientConfig, backend *apiproxy.Backend, connected func()) error {
	client, err := tunnel.NewClient(c)
	if err != nil {
		return err
	}
	a.mu.Lock()
	a.clients[client] = struct{}{}
	a.mu.Unlock()
	defer func() {
		a.mu.Lock()
		delete(a.clients, client)
		a.mu.Unlock()
	}()
	go func() {
		select {
		case <-client.Connected():
			connected()
		case <-ctx.Done():
		}
	}()
	if backend != nil {
		go backend.Serve(ctx, c.Address)
	}
	return client.Run(ctx)
}

// newListener binds the metrics listener, unless MetricsAddress is empty.
func (a *Agent) newListener(*parts) (err error) {
	if a.cfg.MetricsAddress != "" {
		if a.metricsLis, err = net.Listen("tcp", a.cfg.MetricsAddress); err != nil {
			return fmt.Errorf("metrics listener: %w", err)
		}
	}
	return nil
}
