package broker

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/health"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata/metadatainformer"
	"k8s.io/utils/clock"
	inventoryinformers "sigs.k8s.io/cluster-inventory-api/client/informers/externalversions"

	"github.com/credbroker/credbroker/pkg/apiproxy"
	"github.com/credbroker/credbroker/pkg/clusterprofile"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/grants"
	"github.com/credbroker/credbroker/pkg/hubkeys"
	"github.com/credbroker/credbroker/pkg/identity"
	"github.com/credbroker/credbroker/pkg/publish"
	"github.com/credbroker/credbroker/pkg/tokenexchange"
	"github.com/credbroker/credbroker/pkg/tunnel"
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

	// handshakes take turns on the exchange and agent ports.
	handshakes *handshakeMetrics

	svid      identity.Source
	keyPair   *identity.KeyPairFile
	informers inventoryinformers.SharedInformerFactory
	profiles  *clusterprofile.Index
	// rbacInformers and accountInformers watch what the revocation
	// triggers check: hub RBAC, and hub ServiceAccounts' metadata.
	rbacInformers    informers.SharedInformerFactory
	accountInformers metadatainformer.SharedInformerFactory
	// accounts reads the hub ServiceAccounts that accountInformers lists.
	accounts grants.Accounts
	grants   *grants.Registry
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
	// unless PublishAccessProvider. hubClient serves the Leases of the
	// publisher and the triggers; leadsTriggers tells whether this replica
	// runs the triggers (runTriggers), and leaseIdentity, drawn once, is
	// its name in the Leases.
	publisher     *publish.Publisher
	hubClient     kubernetes.Interface
	leadsTriggers atomic.Bool
	// triggersLease records whether the hub answers this replica's reads
	// and writes of the triggers' Lease (triggersLeaseReached).
	triggersLease leaseReach
	identityOnce  sync.Once
	leaseIdentity string
	health        *health.Server
	registry      *prometheus.Registry
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
		b.newHubInformers,
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
