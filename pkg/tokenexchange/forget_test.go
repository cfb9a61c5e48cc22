package tokenexchange

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

const consumerUsername = "system:serviceaccount:hub:consumer"

// changingHub is the hub of fakeReviews, on which hub RBAC can stop
// allowing the consumers and their ServiceAccounts can be deleted.
// duringTokenReview and duringAccessReview, when set, run once inside the
// next review of their kind before it is answered: a change that lands
// while the review is in flight.
type changingHub struct {
	*fakeReviews
	denied, deleted                       atomic.Bool
	mu                                    sync.Mutex
	duringTokenReview, duringAccessReview func()
}

func (h *changingHub) hook(during *func()) {
	h.mu.Lock()
	fn := *during
	*during = nil
	h.mu.Unlock()
	if fn != nil {
		fn()
	}
}

type changingTokenReviews struct{ *changingHub }

func (h changingTokenReviews) Create(ctx context.Context, tr *authenticationv1.TokenReview, o metav1.CreateOptions) (*authenticationv1.TokenReview, error) {
	out, err := h.fakeReviews.Create(ctx, tr, o)
	if err == nil && h.deleted.Load() {
		out.Status = authenticationv1.TokenReviewStatus{Error: "service account hub/consumer has been deleted"}
	}
	h.hook(&h.duringTokenReview)
	return out, err
}

type changingAccessReviews struct{ *changingHub }

func (h changingAccessReviews) Create(ctx context.Context, sar *authorizationv1.SubjectAccessReview, o metav1.CreateOptions) (*authorizationv1.SubjectAccessReview, error) {
	out, err := fakeAccessReviews{h.fakeReviews}.Create(ctx, sar, o)
	if err == nil && h.denied.Load() {
		out.Status.Allowed = false
	}
	h.hook(&h.duringAccessReview)
	return out, err
}

func newChangingFixture(t *testing.T) (*fixture, *changingHub) {
	hub := &changingHub{fakeReviews: &fakeReviews{}}
	f := newFixture(t, func(c *Config) {
		c.TokenReviews, c.AccessReviews = changingTokenReviews{hub}, changingAccessReviews{hub}
	})
	f.reviews = hub.fakeReviews
	return f, hub
}

// Attack: hub RBAC stops allowing a consumer that keeps calling. The
// revocation trigger revokes its grants, and its very next exchange, allowed
// by the SubjectAccessReview decision cached a moment before, mints a new
// token that nothing revokes until the next sweep.
// Defence: a change of hub RBAC makes every cached decision stale at once
// (RBACChanged, called from the RBAC informers on every replica), and a
// review that was in flight when the change came is not served either.
func TestRBACChangeEndsCachedAllows(t *testing.T) {
	t.Run("cached", func(t *testing.T) {
		f, hub := newChangingFixture(t)
		_, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
		require.NoError(t, err)
		hub.denied.Store(true)
		_, err = f.svc.Exchange(withBearer(consumerToken), fleetA())
		require.NoError(t, err, "within its TTL, the cached allow serves: the hub said nothing yet")

		f.svc.RBACChanged()
		_, err = f.svc.Exchange(withBearer(consumerToken), fleetA())
		require.Equal(t, codes.PermissionDenied, status.Code(err), "%v", err)
		assert.Equal(t, int32(2), f.reviews.accessReviews.Load())
		assert.Equal(t, int32(1), f.reviews.tokenReviews.Load(), "an RBAC change leaves authentication alone")
	})

	t.Run("in flight", func(t *testing.T) {
		f, hub := newChangingFixture(t)
		// The hub answers the first review as it stood, while RBAC changes.
		hub.duringAccessReview = func() {
			hub.denied.Store(true)
			f.svc.RBACChanged()
		}
		_, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
		require.Equal(t, codes.PermissionDenied, status.Code(err), "an allow reviewed across the change served: %v", err)
		assert.Equal(t, int32(2), f.reviews.accessReviews.Load())
	})

	t.Run("other decisions stay", func(t *testing.T) {
		f, _ := newChangingFixture(t)
		_, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
		require.NoError(t, err)
		f.svc.SubjectChanged("system:serviceaccount:hub:someone-else")
		_, err = f.svc.Exchange(withBearer(consumerToken), fleetA())
		require.NoError(t, err)
		assert.Equal(t, []int32{1, 1}, []int32{f.reviews.tokenReviews.Load(), f.reviews.accessReviews.Load()},
			"another subject's change costs this one no review")
	})
}

// Attack: a consumer's hub ServiceAccount is deleted, and its next
// exchange, authenticated by the TokenReview cached a moment before, mints
// a token under the deleted account.
// Defence: SubjectChanged, called from the ServiceAccount informer on every
// replica, makes the subject's cached decisions stale, including a review
// in flight.
func TestDeletedServiceAccountEndsCachedAuthentication(t *testing.T) {
	t.Run("cached", func(t *testing.T) {
		f, hub := newChangingFixture(t)
		_, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
		require.NoError(t, err)
		hub.deleted.Store(true)
		f.svc.SubjectChanged(consumerUsername)
		_, err = f.svc.Exchange(withBearer(consumerToken), fleetA())
		require.Equal(t, codes.Unauthenticated, status.Code(err), "%v", err)
		assert.Equal(t, int32(2), f.reviews.tokenReviews.Load())
	})

	t.Run("in flight", func(t *testing.T) {
		f, hub := newChangingFixture(t)
		hub.duringTokenReview = func() {
			hub.deleted.Store(true)
			f.svc.SubjectChanged(consumerUsername)
		}
		_, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
		require.Equal(t, codes.Unauthenticated, status.Code(err), "a review from before the deletion served: %v", err)
	})

	t.Run("its allows too", func(t *testing.T) {
		f, hub := newChangingFixture(t)
		_, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
		require.NoError(t, err)
		// Created again under the same name, with no RBAC (the fake still
		// authenticates it): the old allow is not the new account's.
		hub.denied.Store(true)
		f.svc.SubjectChanged(consumerUsername)
		_, err = f.svc.Exchange(withBearer(consumerToken), fleetA())
		require.Equal(t, codes.PermissionDenied, status.Code(err), "%v", err)
	})
}

// A hub whose RBAC changes during every review gets no decision served
// that predates the change: the call fails Unavailable after a few rounds.
func TestDecisionsThatKeepGoingStaleAreUnavailable(t *testing.T) {
	f, hub := newChangingFixture(t)
	var rounds int
	var during func()
	during = func() {
		rounds++
		f.svc.RBACChanged()
		hub.duringAccessReview = during // hook has cleared it; set it again for the next review
	}
	hub.duringAccessReview = during
	_, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
	require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
	assert.Contains(t, err.Error(), "kept changing")
	assert.Equal(t, maxStaleRounds, rounds)
}

// A forgotten subject is remembered only as long as a decision reviewed
// before may live, and past maxForgottenSubjects every subject is forgotten
// at once, so that the memory stays bounded.
func TestForgetsAreBounded(t *testing.T) {
	f := newFixture(t)
	fg := f.svc.forgets
	before := fg.next()
	fg.subjectChanged("a")
	assert.True(t, fg.subjectStale("a", before))
	assert.False(t, fg.subjectStale("b", before))
	assert.False(t, fg.subjectStale("a", fg.next()))
	assert.True(t, fg.subjectChangedRecently("a"))
	assert.False(t, fg.subjectChangedRecently("b"))

	f.clock.Step(fg.keep + time.Second)
	assert.False(t, fg.subjectChangedRecently("a"), "past keep, the hub's own review decides again")
	fg.subjectChanged("b")
	assert.NotContains(t, fg.subjects, "a", "a forget older than keep is dropped")

	for i := range maxForgottenSubjects {
		fg.subjectChanged(string(rune('c' + i)))
	}
	assert.LessOrEqual(t, len(fg.subjects), maxForgottenSubjects)
	assert.True(t, fg.subjectStale("never-named", before), "past the bound, every subject is forgotten")
	assert.True(t, fg.subjectChangedRecently("never-named"))
}

// fakeAccounts is an informer's view of the hub's ServiceAccounts.
type fakeAccounts struct {
	mu    sync.Mutex
	uids  map[string]types.UID // by namespace/name
	known bool
}

func (a *fakeAccounts) ServiceAccountUID(namespace, name string) (types.UID, bool, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	uid, ok := a.uids[namespace+"/"+name]
	return uid, ok, a.known
}

func (a *fakeAccounts) set(key string, uid types.UID) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if uid == "" {
		delete(a.uids, key)
	} else {
		a.uids[key] = uid
	}
}

// Attack: a consumer's hub ServiceAccount is deleted, or deleted and
// created again, and the hub's TokenReview goes on authenticating the old
// token for its own token cache's TTL (10 s on kube-apiserver), so that a
// review asked again after the change still answers yes. Before: the e2e
// attack got 288 exchanges and 6 new tokens in the 14 s after the
// deletion.
// Defence: the exchange checks the account against the ServiceAccount
// informer, by name and UID, on every call, cached or not; until the
// informer has listed, the TokenReview decides alone.
func TestTokenOfAGoneServiceAccountIsRefused(t *testing.T) {
	accounts := &fakeAccounts{uids: map[string]types.UID{"hub/consumer": "consumer-uid"}, known: true}
	f := newFixture(t, func(c *Config) { c.Accounts = accounts })
	_, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
	require.NoError(t, err)

	// Not listed, and never seen to go: created a moment ago, and not
	// listed yet by the informer; the TokenReview decides.
	accounts.set("hub/consumer", "")
	_, err = f.svc.Exchange(withBearer(consumerToken), fleetA())
	require.NoError(t, err, "an account the informer has not listed yet is refused")

	// Seen to go.
	f.svc.SubjectChanged(consumerUsername)
	_, err = f.svc.Exchange(withBearer(consumerToken), fleetA())
	require.Equal(t, codes.Unauthenticated, status.Code(err), "%v", err)
	assert.Contains(t, err.Error(), "the hub ServiceAccount hub/consumer of the token no longer exists")

	accounts.set("hub/consumer", "consumer-uid-2")
	_, err = f.svc.Exchange(withBearer(consumerToken), fleetA())
	require.Equal(t, codes.Unauthenticated, status.Code(err), "%v", err)
	assert.Contains(t, err.Error(), "was deleted and created again")

	accounts.mu.Lock()
	accounts.known = false
	accounts.mu.Unlock()
	_, err = f.svc.Exchange(withBearer(consumerToken), fleetA())
	require.NoError(t, err, "an informer that has not listed decides nothing")
	assert.Equal(t, int32(2), f.reviews.tokenReviews.Load(), "the check costs no review (the second is SubjectChanged's)")
}
