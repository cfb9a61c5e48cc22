package spoke

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/go-logr/logr"
	authenticationv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	corev1listers "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/pkg/token"
	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

const (
	// DefaultMinExpiration is the default and the smallest MinExpiration: the
	// shortest lifetime the TokenRequest API accepts.
	DefaultMinExpiration = token.MinExpiration
	// DefaultMaxExpiration is the default MaxExpiration.
	DefaultMaxExpiration = time.Hour
	// maxTokenRequestExpiration is the longest lifetime the TokenRequest API
	// accepts.
	maxTokenRequestExpiration = (1 << 32) * time.Second
	// DefaultCollectInterval is the default CollectInterval.
	DefaultCollectInterval = time.Minute
	// cleanupTimeout bounds deleting a grant whose mint failed, which
	// outlives the mint's own context.
	cleanupTimeout = 10 * time.Second
)

// TokenCreator creates a token for a ServiceAccount with the TokenRequest
// API. NewTokenCreator adapts a clientset; tests use a fake.
type TokenCreator interface {
	CreateToken(ctx context.Context, namespace, name string, req *authenticationv1.TokenRequest) (*authenticationv1.TokenRequest, error)
}

// NewTokenCreator returns a TokenCreator that calls
// CoreV1().ServiceAccounts(namespace).CreateToken on client. The client's
// identity needs create on serviceaccounts/token.
func NewTokenCreator(client kubernetes.Interface) TokenCreator {
	return clientTokenCreator{client: client}
}

type clientTokenCreator struct{ client kubernetes.Interface }

func (c clientTokenCreator) CreateToken(ctx context.Context, namespace, name string, req *authenticationv1.TokenRequest) (*authenticationv1.TokenRequest, error) {
	return c.client.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, name, req, metav1.CreateOptions{})
}

// Config configures a Minter.
type Config struct {
	// Tokens mints tokens on the spoke; required.
	Tokens TokenCreator
	// ServiceAccounts reads the spoke's ServiceAccounts, and so their
	// AllowedSubjectsAnnotation, from an informer's cache, so a policy check
	// costs no API call; required. Wait for the informer to sync before the
	// first Mint: until then every ServiceAccount looks missing. Mint sees
	// only what the informer watches, so a namespace-scoped informer limits
	// the agent to that namespace.
	ServiceAccounts corev1listers.ServiceAccountLister
	// MinExpiration is the shortest lifetime of a minted token, in whole
	// seconds; shorter requests get it. Zero means DefaultMinExpiration,
	// which is also the smallest value allowed.
	MinExpiration time.Duration
	// MaxExpiration is the longest lifetime of a minted token, in whole
	// seconds; longer requests, and requests that name none, get it. Zero
	// means DefaultMaxExpiration. It must be at least MinExpiration.
	MaxExpiration time.Duration
	// Grants creates the grant Secret each token is bound to, and deletes
	// it when the token expires; required. Mint fails when it cannot create
	// one: there is no unbound token.
	Grants GrantStore
	// GrantCache is the agent's view of its grants: the indexer of the
	// informer NewGrantInformer returns (it needs GrantIndexers); required.
	// Run's sweep, Reconcile, Snapshot and Revoke read grants from it, so
	// that an agent costs the spoke API server a watch rather than a list
	// every CollectInterval. Register GrantEvents on that informer, and
	// wait for it to sync before Run and before the first Snapshot.
	GrantCache cache.Indexer
	// CollectInterval is how often Run lists grants to delete those whose
	// token has expired. Zero means DefaultCollectInterval.
	CollectInterval time.Duration
	// Access asks the spoke API server, with SubjectAccessReviews, whether
	// a ServiceAccount may create ServiceAccount tokens or impersonate:
	// Mint refuses such a ServiceAccount, whose token could make itself a
	// credential that no grant binds (escalation.go). The agent
	// passes NewAccessReviewer. Nil skips the check, for tests that fake
	// the spoke only.
	Access AccessReviewer
	// AllowEscalating are the ServiceAccounts that Mint serves even though
	// they may escalate: a Name of AllowAllInNamespace allows every one of
	// the Namespace. Only the spoke admin who runs the agent sets it, with
	// AllowEscalatingFlag; no annotation does.
	AllowEscalating []types.NamespacedName
	// EscalationTTL is how long Access's answers for a ServiceAccount are
	// kept: a change to its RBAC takes that long to be seen. Zero means
	// DefaultEscalationTTL.
	EscalationTTL time.Duration
	// PoolSize is how many pooled grants Run keeps ready for each
	// ServiceAccount Mint has minted for (pool.go): a mint that finds one
	// answers after its TokenRequest alone, and records the token's owner
	// on the grant right after. Zero disables the pool: every mint creates
	// its grant first. The agent's default is DefaultPoolSize.
	PoolSize int
	// Clock times grant expiry and the escalation answers; nil means the
	// real clock.
	Clock clock.WithTickerAndDelayedExecution
	// Log receives one line per mint and per refusal; the zero value
	// discards them. It never receives a token.
	Log logr.Logger
}

// Minter mints spoke ServiceAccount tokens for hub subjects under the
// spoke's own policy. It is safe for concurrent use.
type Minter struct {
	tokens     TokenCreator
	grants     GrantStore
	grantCache cache.Indexer
	sas        corev1listers.ServiceAccountLister
	minSeconds int64
	maxSeconds int64
	interval   time.Duration
	clock      clock.WithTickerAndDelayedExecution
	log        logr.Logger
	escalation *escalationChecker

	mu sync.Mutex
	// runCtx is Run's context while Run runs; nil otherwise. Grants minted
	// while Run does not run are left to its first sweep.
	runCtx context.Context
	// timers delete grants when their token expires, by grant UID.
	timers map[types.UID]clock.Timer
	// queue holds the ServiceAccounts whose policy changed, for Run to
	// revoke the grants it no longer allows; nil until Run starts it.
	queue workqueue.TypedRateLimitingInterface[types.NamespacedName]

	subMu sync.RWMutex
	// subscribers are called with every change to the grants (Subscribe).
	// Each is keyed by a pointer of its own, which Subscribe's unsubscribe
	// deletes.
	subscribers map[*func(*credbrokerv1alpha1.GrantUpdate)]struct{}

	// changes holds the grants someone other than the agent changed
	// (tamper.go).
	changes changeTracker

	// pool holds the pooled grants, and claims those claimed whose claim
	// the grant cache does not show yet (pool.go, claim.go).
	pool   grantPool
	claims pendingClaims

	// removed remembers the removals of grants whose tokens have not
	// expired (removed.go).
	removed removals
}

// New returns a Minter, or an error if cfg is incomplete or its expiration
// bounds are out of range.
func New(cfg Config) (*Minter, error) {
	if cfg.Tokens == nil {
		return nil, errors.New("spoke config: Tokens is required")
	}
	if cfg.ServiceAccounts == nil {
		return nil, errors.New("spoke config: ServiceAccounts is required")
	}
	if cfg.Grants == nil {
		return nil, errors.New("spoke config: Grants is required")
	}
	if cfg.GrantCache == nil {
		return nil, errors.New("spoke config: GrantCache is required")
	}
	for _, name := range slices.Sorted(maps.Keys(GrantIndexers())) {
		if _, ok := cfg.GrantCache.GetIndexers()[name]; !ok {
			return nil, fmt.Errorf("spoke config: GrantCache has no index %q; build it with GrantIndexers", name)
		}
	}
	if cfg.PoolSize < 0 {
		return nil, fmt.Errorf("spoke config: PoolSize %d is negative", cfg.PoolSize)
	}
	if cfg.CollectInterval < 0 {
		return nil, fmt.Errorf("spoke config: CollectInterval %s is negative", cfg.CollectInterval)
	}
	interval := cfg.CollectInterval
	if interval == 0 {
		interval = DefaultCollectInterval
	}
	clk := cfg.Clock
	if clk == nil {
		clk = clock.RealClock{}
	}
	minExp, maxExp := cfg.MinExpiration, cfg.MaxExpiration
	if minExp == 0 {
		minExp = DefaultMinExpiration
	}
	if maxExp == 0 {
		maxExp = DefaultMaxExpiration
	}
	switch {
	case minExp%time.Second != 0 || maxExp%time.Second != 0:
		return nil, fmt.Errorf("spoke config: MinExpiration %s and MaxExpiration %s must be whole seconds", minExp, maxExp)
	case minExp < DefaultMinExpiration:
		return nil, fmt.Errorf("spoke config: MinExpiration %s is shorter than %s, the TokenRequest API's minimum", minExp, DefaultMinExpiration)
	case maxExp < minExp:
		return nil, fmt.Errorf("spoke config: MaxExpiration %s is shorter than MinExpiration %s", maxExp, minExp)
	case maxExp > maxTokenRequestExpiration:
		return nil, fmt.Errorf("spoke config: MaxExpiration %s is longer than %s, the TokenRequest API's maximum", maxExp, maxTokenRequestExpiration)
	}
	escalation, err := newEscalationChecker(cfg.Access, cfg.AllowEscalating, cfg.EscalationTTL, clk)
	if err != nil {
		return nil, err
	}
	return &Minter{
		escalation:  escalation,
		tokens:      cfg.Tokens,
		grants:      cfg.Grants,
		grantCache:  cfg.GrantCache,
		sas:         cfg.ServiceAccounts,
		minSeconds:  int64(minExp / time.Second),
		maxSeconds:  int64(maxExp / time.Second),
		interval:    interval,
		clock:       clk,
		log:         cfg.Log,
		timers:      map[types.UID]clock.Timer{},
		subscribers: map[*func(*credbrokerv1alpha1.GrantUpdate)]struct{}{},
		pool:        grantPool{size: cfg.PoolSize, ready: map[types.NamespacedName][]pooledGrant{}},
	}, nil
}
