package broker

import (
	"context"
	"fmt"
	"net"

	"golang.org/x/time/rate"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	inventory "sigs.k8s.io/cluster-inventory-api/client/clientset/versioned"
	inventoryinformers "sigs.k8s.io/cluster-inventory-api/client/informers/externalversions"

	"github.com/credbroker/credbroker/internal/metrics"
	"github.com/credbroker/credbroker/pkg/clusterprofile"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/grants"
	"github.com/credbroker/credbroker/pkg/identity"
	"github.com/credbroker/credbroker/pkg/tokenexchange"
	"github.com/credbroker/credbroker/pkg/tunnel"
)

// The steps of New: each builds one part of the Broker, in this file's
// order, and returns an error that New wraps with "broker: ".

// hubClients holds the hub clients that New's steps build the parts with; the
// Broker keeps none of them but hubClient, for its Leases.
type hubClients struct {
	config    *rest.Config
	client    kubernetes.Interface
	inventory inventory.Interface
	// tokenReviews and accessReviews are the hub's reviews, timed in the
	// registry's metrics.
	tokenReviews  timedTokenReviews
	accessReviews timedAccessReviews
}

// newIdentity loads the broker's SVID source, its ID
// spiffe://<td>/broker unless SPIFFEID says otherwise, and the exchange
// port's key pair.
func (b *Broker) newIdentity(*hubClients) (err error) {
	cfg := b.cfg
	if b.svid, err = cfg.NewSource(context.Background(), fleet.BrokerID(cfg.TrustDomain), cfg.Log.WithName("svid")); err != nil {
		return err
	}
	b.keyPair, err = identity.NewKeyPairFile(context.Background(), identity.KeyPairFileConfig{
		CertFile: cfg.TLSCertFile, KeyFile: cfg.TLSKeyFile, Interval: cfg.FileCheckInterval, Log: cfg.Log.WithName("tls"),
	})
	return err
}

// newHubClients builds the hub clients, with HubQPS and HubBurst.
func (b *Broker) newHubClients(h *hubClients) (err error) {
	h.config = rest.CopyConfig(b.cfg.Hub)
	h.config.QPS, h.config.Burst = b.cfg.HubQPS, b.cfg.HubBurst
	h.config.UserAgent = "credbroker-broker"
	if h.client, err = kubernetes.NewForConfig(h.config); err != nil {
		return fmt.Errorf("hub client: %w", err)
	}
	b.hubClient = h.client
	if h.inventory, err = inventory.NewForConfig(h.config); err != nil {
		return fmt.Errorf("hub inventory client: %w", err)
	}
	return nil
}

// newProfiles builds the ClusterProfile informer and its index.
func (b *Broker) newProfiles(h *hubClients) (err error) {
	b.informers = inventoryinformers.NewSharedInformerFactory(h.inventory, b.cfg.InformerResync)
	b.profiles, err = clusterprofile.New(clusterprofile.Config{
		Informer:    b.informers.Apis().V1alpha1().ClusterProfiles().Informer(),
		TrustDomain: b.cfg.TrustDomain,
		Log:         b.cfg.Log.WithName("clusterprofiles"),
	})
	return err
}

// newMetrics builds the process's one registry, in which every part
// registers its own metrics, and the hub reviews it times.
func (b *Broker) newMetrics(h *hubClients) error {
	reg, reviews, err := newRegistry(b.svid, b.informers.Apis().V1alpha1().ClusterProfiles().Informer())
	if err != nil {
		return err
	}
	b.registry = reg
	if b.handshakes, err = newHandshakeMetrics(reg); err != nil {
		return err
	}
	h.tokenReviews = timedTokenReviews{h.client.AuthenticationV1().TokenReviews(), reviews}
	h.accessReviews = timedAccessReviews{h.client.AuthorizationV1().SubjectAccessReviews(), reviews}
	return nil
}

// newGrants builds the store of pending revokes and the registry of grants,
// which learns the revokes that other replicas record.
func (b *Broker) newGrants(h *hubClients) (err error) {
	if b.pending, err = newPendingStore(b.cfg, h.client, b); err != nil {
		return err
	}
	// The registry revokes through the tunnel server, which feeds it.
	if b.grants, err = grants.NewRegistry(grants.RegistryConfig{
		Revoker:                 tunnelRevoker{b},
		Pending:                 b.pending,
		MaxGrantBytesPerCluster: b.cfg.MaxGrantBytesPerCluster,
		MaxGrantLifetime:        b.cfg.MaxExpiration,
		RetryInterval:           b.cfg.MintTimeout,
		Log:                     b.cfg.Log.WithName("grants"),
	}); err != nil {
		return err
	}
	b.pending.OnChange(func(revokes []grants.PendingRevoke) { b.grants.Learn(context.Background(), revokes) })
	return nil
}

// newTunnel builds the AgentTunnel server and hooks it to the ClusterProfile
// index and the SVID source.
func (b *Broker) newTunnel(*hubClients) (err error) {
	cfg := b.cfg
	if b.tunnel, err = tunnel.NewServer(tunnel.ServerConfig{
		Resolver:             agentResolver{b.profiles},
		Peer:                 identity.PeerSVID,
		Bundles:              b.svid,
		MintTimeout:          cfg.MintTimeout,
		ReturnWait:           cfg.AgentReturnWait,
		MaxStreamsPerCluster: cfg.MaxStreamsPerCluster,
		Log:                  cfg.Log.WithName("tunnel"),
		Audit:                cfg.Audit,
		Grants:               b.grants,
		Registerer:           b.registry,
		OnSessionsChange: func(key types.NamespacedName) {
			if b.publisher != nil {
				b.publisher.Enqueue(key)
			}
		},
	}); err != nil {
		return err
	}
	b.profiles.OnChange(func(key types.NamespacedName, _ types.UID) {
		// The grants of a deleted or replaced ClusterProfile are revoked
		// first, since the revoke travels on its agent's streams, which
		// Revalidate then closes. Off the informer's goroutine: a revoke
		// waits for the agent, for at most the triggers' RevokeTimeout.
		go func() {
			b.triggers.ClusterProfileChanged(context.Background(), key)
			b.tunnel.Revalidate(key)
		}()
	})
	// A new bundle may have dropped the CA of a connected agent.
	b.svid.OnChange(b.tunnel.Reverify)
	return nil
}

// newPublishing builds the publisher of the access provider, with
// PublishAccessProvider, and registers the gauges of its conflicts and of
// the triggers' leadership, which every replica exposes.
func (b *Broker) newPublishing(h *hubClients) (err error) {
	if b.cfg.PublishAccessProvider {
		if b.publisher, err = newPublisher(b.cfg, b, h.inventory); err != nil {
			return err
		}
	}
	return metrics.Register(b.registry, advertisedConflicts(b), triggersLeader(b))
}

// newExchange builds the hub issuer's keys and the TokenExchange service.
func (b *Broker) newExchange(h *hubClients) (err error) {
	cfg := b.cfg
	if b.keys, err = newIssuerKeys(cfg, h.client, b.registry); err != nil {
		return err
	}
	b.exchange, err = tokenexchange.New(tokenexchange.Config{
		TokenReviews:    h.tokenReviews,
		AccessReviews:   h.accessReviews,
		Verifier:        b.keys,
		Clusters:        clusterprofile.Lookup{Index: b.profiles, Provider: cfg.AccessProviderName},
		Minter:          b.tunnel,
		Grants:          b.grants,
		Accounts:        b.accounts,
		Audience:        cfg.Audience,
		MaxExpiration:   cfg.MaxExpiration,
		AuthnTTL:        cfg.AuthnTTL,
		AllowTTL:        cfg.AllowTTL,
		DenyTTL:         cfg.DenyTTL,
		RateLimit:       rate.Limit(cfg.RateLimit),
		RateBurst:       cfg.RateBurst,
		ReviewRateLimit: rate.Limit(cfg.ReviewRateLimit),
		ReviewBurst:     cfg.ReviewBurst,
		Log:             cfg.Log.WithName("exchange"),
		Audit:           cfg.Audit,
		AuditLog:        cfg.AuditLog,
		Registerer:      b.registry,

		PeerReviewRateLimit:      rate.Limit(cfg.PeerReviewRateLimit),
		PeerReviewBurst:          cfg.PeerReviewBurst,
		NamespaceReviewRateLimit: rate.Limit(cfg.NamespaceReviewRateLimit),
		NamespaceReviewBurst:     cfg.NamespaceReviewBurst,
	})
	return err
}

// newGrantsAPI builds the Grants service and the revocation triggers that
// check the live grants again.
func (b *Broker) newGrantsAPI(h *hubClients) (err error) {
	if b.grantsAPI, err = grants.NewService(grants.ServiceConfig{
		Authenticator: b.exchange,
		AccessReviews: h.accessReviews,
		Grants:        b.grants,
		Log:           b.cfg.Log.WithName("grants"),
		Audit:         b.cfg.Audit,
	}); err != nil {
		return err
	}
	b.triggers, err = newTriggers(b.cfg, h.accessReviews, b)
	return err
}

// newServing builds the data path, the health server (NOT_SERVING until
// Run) and binds the listeners.
func (b *Broker) newServing(*hubClients) (err error) {
	if err := b.newDataPath(); err != nil {
		return err
	}
	b.health = health.NewServer()
	b.health.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)

	if b.exchangeLis, err = net.Listen("tcp", b.cfg.ExchangeAddress); err != nil {
		return fmt.Errorf("exchange listener: %w", err)
	}
	if b.agentLis, err = net.Listen("tcp", b.cfg.AgentAddress); err != nil {
		return fmt.Errorf("agent listener: %w", err)
	}
	if b.cfg.MetricsAddress != "" {
		if b.metricsLis, err = net.Listen("tcp", b.cfg.MetricsAddress); err != nil {
			return fmt.Errorf("metrics listener: %w", err)
		}
	}
	return nil
}
