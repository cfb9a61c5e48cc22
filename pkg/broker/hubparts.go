package broker

import (
	"context"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/time/rate"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/metadata/metadatainformer"

	"github.com/credbroker/credbroker/pkg/grants"
	"github.com/credbroker/credbroker/pkg/hubkeys"
)

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

// newHubInformers builds the informers of what the exchange and the
// revocation triggers check: hub RBAC, and hub ServiceAccounts' metadata
// (not the whole objects, to keep memory small).
func (b *Broker) newHubInformers(h *hubClients) error {
	b.rbacInformers = informers.NewSharedInformerFactory(h.client, b.cfg.InformerResync)
	metaClient, err := metadata.NewForConfig(h.config)
	if err != nil {
		return fmt.Errorf("hub metadata client: %w", err)
	}
	b.accountInformers = metadatainformer.NewSharedInformerFactory(metaClient, b.cfg.InformerResync)
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
		return fmt.Errorf("hub ServiceAccount informer: %w", err)
	}
	b.accounts = grants.Accounts{Informer: accounts}
	return nil
}

// newTriggers builds the revocation triggers over b's Registry and
// ClusterProfile index, with the informers of newHubInformers.
func newTriggers(cfg Config, reviews grants.AccessReviewer, b *Broker) (*grants.Triggers, error) {
	rbac := b.rbacInformers.Rbac().V1()
	return grants.NewTriggers(grants.TriggersConfig{
		Grants:          b.grants,
		AccessReviews:   reviews,
		ClusterProfiles: b.profiles,
		RBAC: []grants.Informer{
			rbac.Roles().Informer(), rbac.RoleBindings().Informer(),
			rbac.ClusterRoles().Informer(), rbac.ClusterRoleBindings().Informer(),
		},
		ServiceAccounts: b.accounts.Informer,
		Decisions:       b.exchange,
		Debounce:        cfg.RBACDebounce,
		MaxDelay:        cfg.RBACDebounceMax,
		Interval:        cfg.GrantRecheckInterval,
		ReviewRate:      rate.Limit(cfg.GrantReviewRateLimit),
		ReviewBurst:     cfg.GrantReviewBurst,
		RevokeTimeout:   cfg.MintTimeout,
		Log:             cfg.Log.WithName("triggers"),
	})
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
