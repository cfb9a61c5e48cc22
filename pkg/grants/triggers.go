package grants

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"golang.org/x/time/rate"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/clock"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// Informer is the part of a client-go shared informer that the triggers
// use; cache.SharedIndexInformer satisfies it.
type Informer interface {
	AddEventHandler(handler cache.ResourceEventHandler) (cache.ResourceEventHandlerRegistration, error)
	HasSynced() bool
	GetStore() cache.Store
}

// ClusterProfiles finds the live incarnation of a ClusterProfile;
// *clusterprofile.Index satisfies it. Get fails with errdefs.ErrNotFound
// when there is none or it is being deleted.
type ClusterProfiles interface {
	Get(namespace, name string) (*v1alpha1.ClusterProfile, error)
}

// Decisions are the hub decisions a replica has cached, which a change of
// hub RBAC or of a hub ServiceAccount makes stale; *tokenexchange.Service
// satisfies it. Decisions and revocation are one system: a trigger that
// revokes a subject's grants for a change must not leave a decision cached
// anywhere that would mint them again, so every replica, leading or not,
// tells its own Decisions of every change its informers see.
type Decisions interface {
	// RBACChanged: hub RBAC changed, and any authorization decision may
	// be stale.
	RBACChanged()
	// SubjectChanged: the hub ServiceAccount of username was deleted or
	// created again.
	SubjectChanged(username string)
}

// TriggersConfig configures Triggers.
type TriggersConfig struct {
	// Grants is the broker's Registry; required.
	Grants Table
	// AccessReviews asks the hub's authorizer; required.
	AccessReviews AccessReviewer
	// ClusterProfiles is the broker's ClusterProfile index; required.
	ClusterProfiles ClusterProfiles
	// RBAC are informers of the hub's Roles, RoleBindings, ClusterRoles and
	// ClusterRoleBindings (rbac/v1). NewTriggers adds an event handler to
	// each, so it must be called before they start.
	RBAC []Informer
	// ServiceAccounts is an informer of the hub's ServiceAccounts, such as a
	// metadata-only one (k8s.io/client-go/metadata/metadatainformer);
	// required. NewTriggers adds an event handler to it.
	ServiceAccounts Informer
	// Decisions is told of every change of hub RBAC and of hub
	// ServiceAccounts, as the informers see it, whether or not this
	// replica leads. Default: none.
	Decisions Decisions

	// Clock times the debounce and the sweep. Default: the real clock.
	Clock clock.WithTicker
	// Debounce is the quiet time after an RBAC change before the live
	// grants are checked again, and the time between the two checks of a
	// changed ServiceAccount's grants; MaxDelay bounds the wait from the
	// first RBAC change of a burst. Defaults 2s and 5s.
	Debounce, MaxDelay time.Duration
	// Interval is the period of the sweep that checks every live grant
	// whatever changed. Default 5m.
	Interval time.Duration
	// ReviewRate and ReviewBurst limit the SubjectAccessReviews of the
	// checks, so that a large RBAC change does not flood the hub. Defaults
	// 20 per second, burst 20.
	ReviewRate  rate.Limit
	ReviewBurst int
	// ReviewTimeout bounds one SubjectAccessReview; RevokeTimeout one
	// revoke. Defaults 5s and 10s.
	ReviewTimeout, RevokeTimeout time.Duration
	// Log receives revocations and failed checks. Default: discard.
	Log logr.Logger
}

// Triggers revoke the grants that the hub no longer allows: when hub RBAC
// no longer lets the consumer create clusterprofiles/token on the grant's
// ClusterProfile, when that ClusterProfile is deleted or replaced, and when
// the consumer's hub ServiceAccount is deleted. Serve with Run.
type Triggers struct {
	cfg     TriggersConfig
	limiter *rate.Limiter
	kick    chan struct{}

	mu sync.Mutex
	// rbacFirst and rbacLast are the times of the first and the last RBAC
	// change not checked yet; zero when there is none.
	rbacFirst, rbacLast time.Time
	// accounts are the keys (namespace/name) of the hub ServiceAccounts
	// that changed and are not checked yet.
	accounts map[string]struct{}
	// accountsAgain are the keys of hub ServiceAccounts checked once
	// already, to be checked again at accountsAgainAt, Debounce after the
	// first check: another replica, whose informer saw the change later
	// than this one's, may have minted a grant in between from a decision
	// it had not forgotten yet.
	accountsAgain   map[string]struct{}
	accountsAgainAt time.Time
}

// Defaults of TriggersConfig.
const (
	DefaultTriggerDebounce      = 2 * time.Second
	DefaultTriggerMaxDelay      = 5 * time.Second
	DefaultTriggerInterval      = 5 * time.Minute
	DefaultTriggerReviewRate    = 20
	DefaultTriggerReviewBurst   = 20
	DefaultTriggerReviewTimeout = 5 * time.Second
	DefaultTriggerRevokeTimeout = 10 * time.Second
)

// NewTriggers validates cfg, fills in its defaults and adds event handlers
// to its informers.
func NewTriggers(cfg TriggersConfig) (*Triggers, error) {
	if cfg.Grants == nil || cfg.AccessReviews == nil || cfg.ClusterProfiles == nil || cfg.ServiceAccounts == nil {
		return nil, fmt.Errorf("grants: triggers need Grants, AccessReviews, ClusterProfiles and ServiceAccounts: %w", errdefs.ErrInvalidArgument)
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	cfg.Debounce = orDefault(cfg.Debounce, DefaultTriggerDebounce)
	cfg.MaxDelay = orDefault(cfg.MaxDelay, DefaultTriggerMaxDelay)
	cfg.Interval = orDefault(cfg.Interval, DefaultTriggerInterval)
	cfg.ReviewTimeout = orDefault(cfg.ReviewTimeout, DefaultTriggerReviewTimeout)
	cfg.RevokeTimeout = orDefault(cfg.RevokeTimeout, DefaultTriggerRevokeTimeout)
	cfg.MaxDelay = max(cfg.MaxDelay, cfg.Debounce)
	cfg.ReviewRate = orDefault(cfg.ReviewRate, DefaultTriggerReviewRate)
	cfg.ReviewBurst = orDefault(cfg.ReviewBurst, DefaultTriggerReviewBurst)
	t := &Triggers{
		cfg:      cfg,
		limiter:  rate.NewLimiter(cfg.ReviewRate, cfg.ReviewBurst),
		kick:     make(chan struct{}, 1),
		accounts: map[string]struct{}{},

		accountsAgain: map[string]struct{}{},
	}
	for _, inf := range cfg.RBAC {
		if _, err := inf.AddEventHandler(cache.ResourceEventHandlerDetailedFuncs{
			AddFunc: func(_ any, initial bool) {
				if !initial {
					t.rbacChanged()
				}
			},
			UpdateFunc: func(oldObj, newObj any) {
				if !resync(oldObj, newObj) {
					t.rbacChanged()
				}
			},
			DeleteFunc: func(any) { t.rbacChanged() },
		}); err != nil {
			return nil, fmt.Errorf("grants: RBAC informer: %w", err)
		}
	}
	if _, err := cfg.ServiceAccounts.AddEventHandler(cache.ResourceEventHandlerDetailedFuncs{
		AddFunc: func(obj any, initial bool) {
			// A ServiceAccount created again under an old name: the
			// grants of the old one are not its.
			if !initial {
				t.accountChanged(obj)
			}
		},
		UpdateFunc: func(oldObj, newObj any) {
			if o, err := meta.Accessor(oldObj); err == nil {
				if n, err := meta.Accessor(newObj); err == nil && o.GetUID() != n.GetUID() {
					t.accountChanged(newObj)
				}
			}
		},
		DeleteFunc: t.accountChanged,
	}); err != nil {
		return nil, fmt.Errorf("grants: ServiceAccount informer: %w", err)
	}
	return t, nil
}

// resync reports whether an update is an informer's resync, which changes
// nothing.
func resync(oldObj, newObj any) bool {
	o, err1 := meta.Accessor(oldObj)
	n, err2 := meta.Accessor(newObj)
	return err1 == nil && err2 == nil && o.GetResourceVersion() == n.GetResourceVersion()
}

func (t *Triggers) wake() {
	select {
	case t.kick <- struct{}{}:
	default:
	}
}

func (t *Triggers) rbacChanged() {
	if t.cfg.Decisions != nil {
		t.cfg.Decisions.RBACChanged()
	}
	now := t.cfg.Clock.Now()
	t.mu.Lock()
	if t.rbacFirst.IsZero() {
		t.rbacFirst = now
	}
	t.rbacLast = now
	t.mu.Unlock()
	t.wake()
}

func (t *Triggers) accountChanged(obj any) {
	key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj)
	if err != nil {
		return
	}
	if ns, name, err := cache.SplitMetaNamespaceKey(key); err == nil && t.cfg.Decisions != nil {
		t.cfg.Decisions.SubjectChanged(serviceAccountPrefix + ns + ":" + name)
	}
	t.mu.Lock()
	t.accounts[key] = struct{}{}
	t.mu.Unlock()
	t.wake()
}

// due returns when the next check is due: that of the pending RBAC changes
// (debounced), or the second check of changed ServiceAccounts; and
// whether there is one.
func (t *Triggers) due() (time.Time, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	due := t.rbacDueAt()
	if !t.accountsAgainAt.IsZero() && (due.IsZero() || t.accountsAgainAt.Before(due)) {
		due = t.accountsAgainAt
	}
	return due, !due.IsZero()
}

// rbacDueAt returns when the pending RBAC changes are to be checked: once
// they have been quiet for Debounce, or MaxDelay after the first; zero
// when there are none. t.mu is held.
func (t *Triggers) rbacDueAt() time.Time {
	if t.rbacFirst.IsZero() {
		return time.Time{}
	}
	return minTime(t.rbacLast.Add(t.cfg.Debounce), t.rbacFirst.Add(t.cfg.MaxDelay))
}

// checkDue runs the checks that are due: the RBAC check (rbacDueAt) and
// the second check of changed ServiceAccounts.
func (t *Triggers) checkDue(ctx context.Context) {
	now := t.cfg.Clock.Now()
	t.mu.Lock()
	rbacAt := t.rbacDueAt()
	rbac := !rbacAt.IsZero() && !now.Before(rbacAt)
	if rbac {
		t.rbacFirst, t.rbacLast = time.Time{}, time.Time{}
	}
	var again map[string]struct{}
	if !t.accountsAgainAt.IsZero() && !now.Before(t.accountsAgainAt) {
		again, t.accountsAgain, t.accountsAgainAt = t.accountsAgain, map[string]struct{}{}, time.Time{}
	}
	t.mu.Unlock()
	t.checkAccounts(ctx, again)
	if rbac {
		t.checkRBAC(ctx)
	}
}

// Run checks the grants again on every change and every Interval until ctx
// ends, and returns nil then.
func (t *Triggers) Run(ctx context.Context) error {
	ticker := t.cfg.Clock.NewTicker(t.cfg.Interval)
	defer ticker.Stop()
	for {
		if keys := t.takeAccounts(); len(keys) > 0 {
			t.checkAccounts(ctx, keys)
			t.checkAgainLater(keys)
		}
		var timer clock.Timer
		var fire <-chan time.Time
		if due, ok := t.due(); ok {
			wait := due.Sub(t.cfg.Clock.Now())
			if wait <= 0 {
				t.checkDue(ctx)
				continue
			}
			timer = t.cfg.Clock.NewTimer(wait)
			fire = timer.C()
		}
		select {
		case <-ctx.Done():
		case <-t.kick:
		case <-fire:
		case <-ticker.C():
			t.Sweep(ctx)
		}
		if timer != nil {
			timer.Stop()
		}
		if ctx.Err() != nil {
			return nil
		}
	}
}

// checkAgainLater queues keys for their second check, Debounce after the
// first check of the earliest of them that waits.
func (t *Triggers) checkAgainLater(keys map[string]struct{}) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for k := range keys {
		t.accountsAgain[k] = struct{}{}
	}
	if t.accountsAgainAt.IsZero() {
		t.accountsAgainAt = t.cfg.Clock.Now().Add(t.cfg.Debounce)
	}
}

// Lead is Run for the replica that takes the triggers over, from another
// replica or at its start: it forgets the changes it saw while it did not
// lead, waits for its informers to sync, and checks every live grant once
// (Sweep), which covers those changes and whatever changed while no
// replica led, before it runs Run. Only one replica of a broker needs to
// lead: the SubjectAccessReviews of the checks are the same on every
// replica, since every replica holds the whole fleet's live grants.
func (t *Triggers) Lead(ctx context.Context) error {
	t.mu.Lock()
	t.rbacFirst, t.rbacLast = time.Time{}, time.Time{}
	t.accounts, t.accountsAgain, t.accountsAgainAt = map[string]struct{}{}, map[string]struct{}{}, time.Time{}
	t.mu.Unlock()
	synced := []cache.InformerSynced{t.cfg.ServiceAccounts.HasSynced}
	for _, inf := range t.cfg.RBAC {
		synced = append(synced, inf.HasSynced)
	}
	if !cache.WaitForCacheSync(ctx.Done(), synced...) {
		return nil // ctx ended
	}
	t.Sweep(ctx)
	return t.Run(ctx)
}

// Sweep checks every live grant: its ClusterProfile, its consumer's hub
// ServiceAccount, and hub RBAC. Run calls it every Interval.
func (t *Triggers) Sweep(ctx context.Context) {
	seen := map[types.NamespacedName]bool{}
	accounts := map[string]struct{}{}
	for _, g := range t.cfg.Grants.Select(Selector{}) {
		key := ClusterRef(g).NamespacedName
		if !seen[key] {
			seen[key] = true
			t.ClusterProfileChanged(ctx, key)
		}
		if ns, name, ok := serviceAccountOf(g.GetSubject().GetUsername()); ok {
			accounts[ns+"/"+name] = struct{}{}
		}
	}
	t.checkAccounts(ctx, accounts)
	t.checkRBAC(ctx)
}

// revoke revokes grants for reason, within RevokeTimeout, and logs each.
func (t *Triggers) revoke(ctx context.Context, trigger string, grants []*pb.Grant, reason string) {
	if len(grants) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, t.cfg.RevokeTimeout)
	defer cancel()
	revoked, pending := t.cfg.Grants.Revoke(ctx, grants, reason)
	for _, g := range revoked {
		t.cfg.Log.Info("revoked grant", "trigger", trigger, fleet.LogCredentialID, g.GetCredentialId(),
			fleet.LogSubject, g.GetSubject().GetUsername(), fleet.LogCluster, ClusterRef(g).String(), fleet.LogReason, reason)
	}
	for _, g := range pending {
		t.cfg.Log.Info("revoke of grant pending until its agent reports it", "trigger", trigger, fleet.LogCredentialID, g.GetCredentialId(),
			fleet.LogSubject, g.GetSubject().GetUsername(), fleet.LogCluster, ClusterRef(g).String(), fleet.LogReason, reason)
	}
}

// ClusterProfileChanged revokes the grants of the ClusterProfile key that
// were not minted through its live incarnation: it was deleted, is being
// deleted, or was replaced by one with another UID. It returns once the
// agent answered, or after RevokeTimeout. The broker calls it on every
// change of a ClusterProfile, before it closes the agent streams of a
// deleted one, since the revoke travels on those.
func (t *Triggers) ClusterProfileChanged(ctx context.Context, key types.NamespacedName) {
	grants := t.cfg.Grants.Select(Selector{Cluster: key})
	if len(grants) == 0 {
		return
	}
	var live types.UID
	cp, err := t.cfg.ClusterProfiles.Get(key.Namespace, key.Name)
	switch {
	case err == nil:
		live = cp.UID
	case errors.Is(err, errdefs.ErrNotFound):
	default:
		// Not known yet (the cache has not synced): nothing to decide.
		t.cfg.Log.Info("ClusterProfile not checked; checked again at the next change or sweep", fleet.LogCluster, key.String(), fleet.LogErr, err.Error())
		return
	}
	var stale []*pb.Grant
	for _, g := range grants {
		if types.UID(g.GetClusterUid()) != live {
			stale = append(stale, g)
		}
	}
	reason := fmt.Sprintf("the ClusterProfile %s was deleted", key)
	if live != "" {
		reason = ReasonClusterProfileReplaced
	}
	t.revoke(ctx, "clusterprofile", stale, reason)
}

func (t *Triggers) takeAccounts() map[string]struct{} {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.accounts) == 0 {
		return nil
	}
	out := t.accounts
	t.accounts = map[string]struct{}{}
	return out
}

const serviceAccountPrefix = "system:serviceaccount:"

// serviceAccountOf returns the namespace and name of the ServiceAccount
// that username names, and whether it names one.
func serviceAccountOf(username string) (namespace, name string, ok bool) {
	rest, ok := strings.CutPrefix(username, serviceAccountPrefix)
	if !ok {
		return "", "", false
	}
	namespace, name, ok = strings.Cut(rest, ":")
	return namespace, name, ok && namespace != "" && name != "" && !strings.Contains(name, ":")
}

// checkAccounts revokes the grants of the hub ServiceAccounts of keys that
// are gone or were created again: their UID is not the one the grant
// recorded. It decides nothing before the informer has synced, since until
// then a ServiceAccount may merely not be listed yet.
func (t *Triggers) checkAccounts(ctx context.Context, keys map[string]struct{}) {
	if len(keys) == 0 {
		return
	}
	if !t.cfg.ServiceAccounts.HasSynced() {
		// Checked again at the next sweep.
		return
	}
	accounts := Accounts{Informer: t.cfg.ServiceAccounts}
	for key := range keys {
		ns, name, err := cache.SplitMetaNamespaceKey(key)
		if err != nil {
			continue
		}
		grants := t.cfg.Grants.Select(Selector{Username: serviceAccountPrefix + ns + ":" + name})
		if len(grants) == 0 {
			continue
		}
		uid, _, _ := accounts.ServiceAccountUID(ns, name)
		var stale []*pb.Grant
		for _, g := range grants {
			// A grant that recorded no UID is of whatever ServiceAccount
			// holds the name: only its deletion revokes it.
			if uid == "" || (g.GetSubject().GetUid() != "" && types.UID(g.GetSubject().GetUid()) != uid) {
				stale = append(stale, g)
			}
		}
		reason := fmt.Sprintf("the hub ServiceAccount %s was deleted", key)
		if uid != "" {
			reason = fmt.Sprintf("the hub ServiceAccount %s was deleted and created again", key)
		}
		t.revoke(ctx, "serviceaccount", stale, reason)
	}
}

// Accounts reads hub ServiceAccounts from an informer of them, such as the
// triggers' metadata-only one. The exchange checks with it that the hub
// ServiceAccount of an authenticated token still exists, since the hub's
// TokenReview may go on authenticating a deleted account's token for its
// own token cache's TTL (10 s on kube-apiserver).
type Accounts struct{ Informer Informer }

// ServiceAccountUID returns the UID of the hub ServiceAccount
// namespace/name, whether it exists, and whether the informer can tell
// (it has listed the ServiceAccounts).
func (a Accounts) ServiceAccountUID(namespace, name string) (uid types.UID, exists, known bool) {
	if a.Informer == nil || !a.Informer.HasSynced() {
		return "", false, false
	}
	obj, exists, err := a.Informer.GetStore().GetByKey(namespace + "/" + name)
	if err != nil || !exists {
		return "", false, err == nil
	}
	m, err := meta.Accessor(obj)
	if err != nil {
		return "", false, false
	}
	return m.GetUID(), true, true
}
