package grants

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	authorizationv1 "k8s.io/api/authorization/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	clocktesting "k8s.io/utils/clock/testing"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/hubauth"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// revokeCall is one revoke that reached the agents.
type revokeCall struct {
	cluster fleet.ClusterRef
	ids     []string
	reason  string
}

// recordingRevoker deletes every grant it is asked to, and records the
// calls.
type recordingRevoker struct {
	mu    sync.Mutex
	calls []revokeCall
}

func (r *recordingRevoker) Revoke(_ context.Context, cluster fleet.ClusterRef, ids []string, reason string) ([]string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, revokeCall{cluster, slices.Sorted(slices.Values(ids)), reason})
	return ids, nil
}

func (r *recordingRevoker) revoked() []revokeCall {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.calls)
}

// revokedIDs returns every credential id revoked so far, sorted.
func (r *recordingRevoker) revokedIDs() []string {
	var ids []string
	for _, c := range r.revoked() {
		ids = append(ids, c.ids...)
	}
	slices.Sort(ids)
	return ids
}

// fakeReviewer answers SubjectAccessReviews from a table of what is
// allowed, "user ns/name", and records what it was asked.
type fakeReviewer struct {
	mu      sync.Mutex
	allowed map[string]bool
	err     error
	asked   []authorizationv1.SubjectAccessReviewSpec
}

func (f *fakeReviewer) Create(_ context.Context, sar *authorizationv1.SubjectAccessReview, _ metav1.CreateOptions) (*authorizationv1.SubjectAccessReview, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.asked = append(f.asked, sar.Spec)
	if f.err != nil {
		return nil, f.err
	}
	ra := sar.Spec.ResourceAttributes
	out := sar.DeepCopy()
	out.Status.Allowed = f.allowed[sar.Spec.User+" "+ra.Namespace+"/"+ra.Name] &&
		ra.Verb == "create" && ra.Group == "multicluster.x-k8s.io" && ra.Resource == "clusterprofiles" && ra.Subresource == "token"
	return out, nil
}

func (f *fakeReviewer) set(key string, allowed bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.allowed[key] = allowed
}

func (f *fakeReviewer) fail(err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.err = err
}

func (f *fakeReviewer) questions() []authorizationv1.SubjectAccessReviewSpec {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.asked)
}

// fakeInformer hands its event handlers to the test, over a real store.
type fakeInformer struct {
	mu       sync.Mutex
	handlers []cache.ResourceEventHandler
	store    cache.Store
	synced   bool
}

func newFakeInformer() *fakeInformer {
	return &fakeInformer{store: cache.NewStore(cache.MetaNamespaceKeyFunc), synced: true}
}

func (f *fakeInformer) AddEventHandler(h cache.ResourceEventHandler) (cache.ResourceEventHandlerRegistration, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.handlers = append(f.handlers, h)
	return nil, nil
}

func (f *fakeInformer) HasSynced() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.synced
}

func (f *fakeInformer) GetStore() cache.Store { return f.store }

func (f *fakeInformer) add(obj any, initial bool) {
	_ = f.store.Add(obj)
	for _, h := range f.handlers {
		h.OnAdd(obj, initial)
	}
}

func (f *fakeInformer) update(oldObj, newObj any) {
	_ = f.store.Update(newObj)
	for _, h := range f.handlers {
		h.OnUpdate(oldObj, newObj)
	}
}

func (f *fakeInformer) remove(obj any) {
	_ = f.store.Delete(obj)
	for _, h := range f.handlers {
		h.OnDelete(obj)
	}
}

// fakeProfiles is the ClusterProfile index: live incarnations by key, as
// Index.Get answers (a ClusterProfile being deleted is not found).
type fakeProfiles struct {
	mu       sync.Mutex
	profiles map[types.NamespacedName]*v1alpha1.ClusterProfile
	unsynced bool
}

func (f *fakeProfiles) Get(namespace, name string) (*v1alpha1.ClusterProfile, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.unsynced {
		return nil, fmt.Errorf("not synced: %w", errdefs.ErrUnavailable)
	}
	cp, ok := f.profiles[types.NamespacedName{Namespace: namespace, Name: name}]
	if !ok || cp.DeletionTimestamp != nil {
		return nil, fmt.Errorf("clusterprofile %s/%s %w", namespace, name, errdefs.ErrNotFound)
	}
	return cp.DeepCopy(), nil
}

func (f *fakeProfiles) set(ref fleet.ClusterRef, deleting bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	cp := &v1alpha1.ClusterProfile{ObjectMeta: metav1.ObjectMeta{Namespace: ref.Namespace, Name: ref.Name, UID: ref.UID}}
	if deleting {
		cp.DeletionTimestamp = &metav1.Time{Time: start}
	}
	f.profiles[ref.NamespacedName] = cp
}

func (f *fakeProfiles) remove(key types.NamespacedName) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.profiles, key)
}

// serviceAccount is a hub ServiceAccount as a metadata-only informer holds it.
func serviceAccount(ns, name string, uid types.UID) *metav1.PartialObjectMetadata {
	return &metav1.PartialObjectMetadata{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "ServiceAccount"},
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: uid, ResourceVersion: "1"},
	}
}

const (
	alice = "system:serviceaccount:team-a:alice"
	bob   = "system:serviceaccount:team-b:bob"
	carol = "oidc:carol"
)

// fixture is a Registry with live grants, and Triggers over it.
type fixture struct {
	clock    *clocktesting.FakeClock
	registry *Registry
	revoker  *recordingRevoker
	reviewer *fakeReviewer
	rbac     *fakeInformer
	accounts *fakeInformer
	profiles *fakeProfiles
	triggers *Triggers
}

// subjectGrant is a grant of user (with uid and groups) on cluster.
func subjectGrant(id string, cluster fleet.ClusterRef, user, uid string, groups ...string) *pb.Grant {
	g := grant(id, user, time.Hour)
	g.Subject.Uid, g.Subject.Groups = uid, groups
	g.ClusterUid = string(cluster.UID)
	on(cluster, g)
	return g
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	f := &fixture{
		clock:    clocktesting.NewFakeClock(start),
		revoker:  &recordingRevoker{},
		reviewer: &fakeReviewer{allowed: map[string]bool{}},
		rbac:     newFakeInformer(),
		accounts: newFakeInformer(),
		profiles: &fakeProfiles{profiles: map[types.NamespacedName]*v1alpha1.ClusterProfile{}},
	}
	var err error
	f.registry, err = NewRegistry(RegistryConfig{Revoker: f.revoker, Clock: f.clock})
	require.NoError(t, err)
	f.profiles.set(spoke1, false)
	f.profiles.set(spoke2, false)
	f.accounts.add(serviceAccount("team-a", "alice", "alice-uid"), true)
	f.accounts.add(serviceAccount("team-b", "bob", "bob-uid"), true)
	ctx := t.Context()
	f.registry.Hello(ctx, spoke1, []*pb.Grant{
		subjectGrant("JTI=a1", spoke1, alice, "alice-uid", "system:serviceaccounts", "system:serviceaccounts:team-a"),
		// The same subject, its groups in another order: one review.
		subjectGrant("JTI=a2", spoke1, alice, "alice-uid", "system:serviceaccounts:team-a", "system:serviceaccounts"),
		subjectGrant("JTI=b1", spoke1, bob, "bob-uid", "system:serviceaccounts"),
		subjectGrant("JTI=c1", spoke1, carol, "carol-uid", "people"),
	})
	f.registry.Hello(ctx, spoke2, []*pb.Grant{
		subjectGrant("JTI=a3", spoke2, alice, "alice-uid", "system:serviceaccounts", "system:serviceaccounts:team-a"),
		subjectGrant("JTI=b2", spoke2, bob, "bob-uid", "system:serviceaccounts"),
	})
	for _, key := range []string{alice + " fleet/spoke-1", alice + " fleet/spoke-2", bob + " fleet/spoke-1", bob + " fleet/spoke-2", carol + " fleet/spoke-1"} {
		f.reviewer.allowed[key] = true
	}
	f.triggers, err = NewTriggers(TriggersConfig{
		Grants:          f.registry,
		AccessReviews:   f.reviewer,
		ClusterProfiles: f.profiles,
		RBAC:            []Informer{f.rbac},
		ServiceAccounts: f.accounts,
		Clock:           f.clock,
		Debounce:        2 * time.Second,
		MaxDelay:        5 * time.Second,
		Interval:        5 * time.Minute,
		ReviewRate:      1e6,
		ReviewBurst:     1e6,
	})
	require.NoError(t, err)
	return f
}

// run serves the triggers until the test ends.
func (f *fixture) run(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- f.triggers.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
}

func (f *fixture) live() []string {
	var ids []string
	for _, g := range f.registry.Select(Selector{}) {
		ids = append(ids, g.GetCredentialId())
	}
	slices.Sort(ids)
	return ids
}

// stepUntil advances the fake clock by step, up to limit, until cond holds,
// and returns how far it went.
func (f *fixture) stepUntil(t *testing.T, step, limit time.Duration, cond func() bool) time.Duration {
	t.Helper()
	var went time.Duration
	require.Eventually(t, func() bool {
		if cond() {
			return true
		}
		if went < limit {
			f.clock.Step(step)
			went += step
		}
		return false
	}, 10*time.Second, time.Millisecond)
	return went
}

func userInfo(name, uid string, groups ...string) hubauth.User {
	return hubauth.User{Username: name, UID: uid, Groups: groups}
}

func role(rv string) *rbacv1.Role {
	return &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Namespace: "fleet", Name: "consumers", ResourceVersion: rv}}
}

// The attack: hub RBAC withdraws a consumer's right to a ClusterProfile,
// and the consumer goes on using the spoke tokens it already holds. A burst
// of RBAC changes costs one check, of one review per subject and
// ClusterProfile, and revokes exactly the grants no longer allowed.
func TestRBACChangeRevokesGrantsNoLongerAllowed(t *testing.T) {
	f := newFixture(t)
	f.run(t)
	f.reviewer.set(alice+" fleet/spoke-1", false)

	// The initial list and resyncs are no change.
	f.rbac.add(role("1"), true)
	f.rbac.update(role("1"), role("1"))
	// A burst.
	for i := range 10 {
		f.rbac.update(role(fmt.Sprint(i+1)), role(fmt.Sprint(i+2)))
	}
	f.rbac.remove(role("12"))

	// Done when the grants are revoked and every subject reviewed: the
	// reviews of other subjects may still run when the first revoke is sent.
	went := f.stepUntil(t, 100*time.Millisecond, time.Minute, func() bool {
		return len(f.revoker.revoked()) > 0 && len(f.reviewer.questions()) >= 5
	})
	assert.GreaterOrEqual(t, went, 2*time.Second, "checked before the debounce's quiet time")
	require.Equal(t, []revokeCall{{
		cluster: spoke1, ids: []string{"JTI=a1", "JTI=a2"},
		reason: "hub RBAC no longer allows " + alice + " to create clusterprofiles.multicluster.x-k8s.io/token spoke-1 in namespace fleet",
	}}, f.revoker.revoked())
	assert.Equal(t, []string{"JTI=a3", "JTI=b1", "JTI=b2", "JTI=c1"}, f.live())
	assert.True(t, f.registry.Revoked("JTI=a1"))

	// One review per distinct subject and ClusterProfile, not per grant nor
	// per event.
	asked := f.reviewer.questions()
	require.Len(t, asked, 5)
	for _, spec := range asked {
		if spec.User == alice {
			assert.Equal(t, "alice-uid", spec.UID)
			assert.ElementsMatch(t, []string{"system:serviceaccounts", "system:serviceaccounts:team-a"}, spec.Groups)
		}
	}
	// The review is the exchange's.
	assert.Contains(t, asked, hubauth.AccessReview(
		userInfo(alice, "alice-uid", "system:serviceaccounts", "system:serviceaccounts:team-a"), "create",
		types.NamespacedName{Namespace: "fleet", Name: "spoke-1"}).Spec)
}

// Changes that keep coming are checked MaxDelay after the first one.
func TestRBACDebounceIsBounded(t *testing.T) {
	f := newFixture(t)
	f.run(t)
	f.reviewer.set(bob+" fleet/spoke-2", false)
	for i := range 4 {
		f.rbac.update(role(fmt.Sprint(i)), role(fmt.Sprint(i+1)))
		f.clock.Step(time.Second)
	}
	// At 4s, a change: the quiet time would end at 6s; MaxDelay ends it at
	// 5s, 5s after the first change.
	f.rbac.update(role("10"), role("11"))
	went := f.stepUntil(t, 100*time.Millisecond, time.Second, func() bool { return len(f.revoker.revoked()) > 0 })
	assert.LessOrEqual(t, went, time.Second)
	assert.Equal(t, []string{"JTI=b2"}, f.revoker.revokedIDs())
}

// A review that fails revokes nothing; the next change checks again.
func TestFailedReviewRevokesNothing(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		// asked is how many reviews the failing check makes: when the hub
		// does not answer at all, it stops at the first.
		asked int
	}{
		{"hub down", errors.New("dial tcp 10.0.0.1:6443: connect: connection refused"), 1},
		{"hub times out", context.DeadlineExceeded, 1},
		{"hub answers with an error", apierrors.NewInternalError(errors.New("etcd")), 5},
		{"hub refuses the broker", apierrors.NewForbidden(authorizationv1.Resource("subjectaccessreviews"), "", errors.New("no")), 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			f.reviewer.set(alice+" fleet/spoke-1", false)
			f.reviewer.fail(tc.err)
			f.triggers.Sweep(t.Context())
			assert.Empty(t, f.revoker.revoked())
			assert.Len(t, f.live(), 6)
			assert.Len(t, f.reviewer.questions(), tc.asked)

			f.reviewer.fail(nil)
			f.run(t)
			f.rbac.remove(role("1"))
			f.stepUntil(t, 100*time.Millisecond, time.Minute, func() bool { return len(f.revoker.revoked()) > 0 })
			assert.Equal(t, []string{"JTI=a1", "JTI=a2"}, f.revoker.revokedIDs())
		})
	}
}

// The slow sweep finds what no event told of.
func TestSweepRevokesGrantsNoLongerAllowed(t *testing.T) {
	f := newFixture(t)
	f.run(t)
	f.reviewer.set(carol+" fleet/spoke-1", false)
	f.stepUntil(t, 10*time.Second, 6*time.Minute, func() bool { return len(f.revoker.revoked()) > 0 })
	assert.Equal(t, []string{"JTI=c1"}, f.revoker.revokedIDs())
}

// The attack: a ClusterProfile is deleted, or replaced by another
// incarnation, and the tokens minted through it stay valid.
func TestClusterProfileGoneRevokesItsGrants(t *testing.T) {
	replaced := fleet.ClusterRef{NamespacedName: spoke1.NamespacedName, UID: "uid-1-again"}
	for _, tc := range []struct {
		name    string
		change  func(*fakeProfiles)
		revoked []string
		reason  string
	}{
		{"deleted", func(p *fakeProfiles) { p.remove(spoke1.NamespacedName) },
			[]string{"JTI=a1", "JTI=a2", "JTI=b1", "JTI=c1"}, "the ClusterProfile fleet/spoke-1 was deleted"},
		{"being deleted", func(p *fakeProfiles) { p.set(spoke1, true) },
			[]string{"JTI=a1", "JTI=a2", "JTI=b1", "JTI=c1"}, "the ClusterProfile fleet/spoke-1 was deleted"},
		{"replaced", func(p *fakeProfiles) { p.set(replaced, false) },
			[]string{"JTI=a1", "JTI=a2", "JTI=b1", "JTI=c1"}, ReasonClusterProfileReplaced},
		{"updated", func(*fakeProfiles) {}, nil, ""},
		{"not synced", func(p *fakeProfiles) { p.remove(spoke1.NamespacedName); p.unsynced = true }, nil, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			tc.change(f.profiles)
			f.triggers.ClusterProfileChanged(t.Context(), spoke1.NamespacedName)
			if tc.revoked == nil {
				assert.Empty(t, f.revoker.revoked())
				return
			}
			// Revoked through the incarnation the grants were minted
			// through, whose agent streams are still open.
			assert.Equal(t, []revokeCall{{cluster: spoke1, ids: tc.revoked, reason: tc.reason}}, f.revoker.revoked())
			assert.Equal(t, []string{"JTI=a3", "JTI=b2"}, f.live())
		})
	}
}

// The sweep finds a ClusterProfile whose change no event told of.
func TestSweepRevokesGrantsOfGoneClusterProfiles(t *testing.T) {
	f := newFixture(t)
	f.profiles.remove(spoke2.NamespacedName)
	f.triggers.Sweep(t.Context())
	assert.Equal(t, []string{"JTI=a3", "JTI=b2"}, f.revoker.revokedIDs())
}

// The attack: a consumer's hub ServiceAccount is deleted, and the spoke
// tokens minted for it stay valid; or a new ServiceAccount of the same name
// inherits them.
func TestHubServiceAccountGoneRevokesItsGrants(t *testing.T) {
	for _, tc := range []struct {
		name    string
		change  func(*fakeInformer)
		revoked []string
		reason  string
	}{
		{"deleted", func(i *fakeInformer) { i.remove(serviceAccount("team-a", "alice", "alice-uid")) },
			[]string{"JTI=a1", "JTI=a2", "JTI=a3"}, "the hub ServiceAccount team-a/alice was deleted"},
		{"deleted unseen", func(i *fakeInformer) {
			_ = i.store.Delete(serviceAccount("team-a", "alice", "alice-uid"))
			for _, h := range i.handlers {
				h.OnDelete(cache.DeletedFinalStateUnknown{Key: "team-a/alice"})
			}
		}, []string{"JTI=a1", "JTI=a2", "JTI=a3"}, "the hub ServiceAccount team-a/alice was deleted"},
		{"created again", func(i *fakeInformer) {
			_ = i.store.Delete(serviceAccount("team-a", "alice", "alice-uid"))
			i.add(serviceAccount("team-a", "alice", "alice-uid-2"), false)
		}, []string{"JTI=a1", "JTI=a2", "JTI=a3"}, "the hub ServiceAccount team-a/alice was deleted and created again"},
		{"updated", func(i *fakeInformer) {
			sa := serviceAccount("team-a", "alice", "alice-uid")
			sa.ResourceVersion = "2"
			i.update(serviceAccount("team-a", "alice", "alice-uid"), sa)
		}, nil, ""},
		{"another one deleted", func(i *fakeInformer) { i.remove(serviceAccount("team-a", "dave", "dave-uid")) }, nil, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			f.run(t)
			tc.change(f.accounts)
			if tc.revoked == nil {
				// Then a change that does revoke, to know the first was
				// handled.
				f.accounts.remove(serviceAccount("team-b", "bob", "bob-uid"))
				require.Eventually(t, func() bool { return len(f.revoker.revoked()) >= 2 }, 10*time.Second, time.Millisecond)
				assert.Equal(t, []string{"JTI=b1", "JTI=b2"}, f.revoker.revokedIDs())
				return
			}
			require.Eventually(t, func() bool { return len(f.revoker.revokedIDs()) == len(tc.revoked) }, 10*time.Second, time.Millisecond)
			assert.Equal(t, tc.revoked, f.revoker.revokedIDs())
			for _, c := range f.revoker.revoked() {
				assert.Equal(t, tc.reason, c.reason)
			}
			assert.Equal(t, []string{"JTI=b1", "JTI=b2", "JTI=c1"}, f.live())
		})
	}
}

// The sweep compares every consumer's ServiceAccount, and decides nothing
// before the informer has listed them.
func TestSweepRevokesGrantsOfGoneServiceAccounts(t *testing.T) {
	f := newFixture(t)
	_ = f.accounts.store.Delete(serviceAccount("team-b", "bob", "bob-uid"))
	_ = f.accounts.store.Add(serviceAccount("team-a", "alice", "another-uid"))
	f.accounts.synced = false
	f.triggers.Sweep(t.Context())
	assert.Empty(t, f.revoker.revoked())

	f.accounts.synced = true
	f.triggers.Sweep(t.Context())
	assert.Equal(t, []string{"JTI=a1", "JTI=a2", "JTI=a3", "JTI=b1", "JTI=b2"}, f.revoker.revokedIDs())
	assert.Equal(t, []string{"JTI=c1"}, f.live())
}

func TestServiceAccountOf(t *testing.T) {
	for _, tc := range []struct {
		username, ns, name string
		ok                 bool
	}{
		{"system:serviceaccount:team-a:alice", "team-a", "alice", true},
		{"system:serviceaccount:team-a", "", "", false},
		{"system:serviceaccount::alice", "", "", false},
		{"system:serviceaccount:team-a:", "", "", false},
		{"system:serviceaccount:a:b:c", "", "", false},
		{"system:serviceaccounts:team-a", "", "", false},
		{"alice", "", "", false},
		{"", "", "", false},
	} {
		ns, name, ok := serviceAccountOf(tc.username)
		assert.Equal(t, tc.ok, ok, tc.username)
		if ok {
			assert.Equal(t, []string{tc.ns, tc.name}, []string{ns, name})
		}
	}
}

func TestNewTriggersNeedsItsParts(t *testing.T) {
	_, err := NewTriggers(TriggersConfig{})
	require.ErrorIs(t, err, errdefs.ErrInvalidArgument)
}

// The attack: a revocation trigger fires while no replica leads the
// triggers (the leader died and its Lease has not expired yet, or it died
// between an RBAC change and its debounced check), and the consumer keeps
// its spoke tokens. The replica that takes over checks every live grant
// before anything else, with no wait and no clock step, whether its own
// informers told it of the change or not; what they told it while it
// followed costs no second check.
func TestLeadChecksWhatChangedWhileNoReplicaLed(t *testing.T) {
	for _, tc := range []struct {
		name    string
		change  func(*fixture)
		revoked []string
		// reviews is the sweep's: one per subject and ClusterProfile of
		// the grants left once those of gone ServiceAccounts are revoked.
		reviews int
	}{
		{"hub RBAC changed, seen while following", func(f *fixture) {
			f.reviewer.set(alice+" fleet/spoke-1", false)
			f.rbac.remove(role("1"))
		}, []string{"JTI=a1", "JTI=a2"}, 5},
		{"hub RBAC changed, its event gone with the old leader", func(f *fixture) {
			f.reviewer.set(alice+" fleet/spoke-1", false)
		}, []string{"JTI=a1", "JTI=a2"}, 5},
		{"hub ServiceAccount deleted", func(f *fixture) {
			f.accounts.remove(serviceAccount("team-b", "bob", "bob-uid"))
		}, []string{"JTI=b1", "JTI=b2"}, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			tc.change(f)
			ctx, cancel := context.WithCancel(t.Context())
			done := make(chan error, 1)
			go func() { done <- f.triggers.Lead(ctx) }()
			require.Eventually(t, func() bool {
				return len(f.revoker.revokedIDs()) == len(tc.revoked) && len(f.reviewer.questions()) >= tc.reviews
			}, 10*time.Second, time.Millisecond)
			f.clock.Step(10 * time.Second)    // past any debounce
			time.Sleep(50 * time.Millisecond) // a second check would be under way: no synchronization to wait for one that must not come
			cancel()
			require.NoError(t, <-done)
			assert.Equal(t, tc.revoked, f.revoker.revokedIDs())
			assert.Len(t, f.reviewer.questions(), tc.reviews, "the sweep's reviews, and no second check")
		})
	}
}
