package tokenexchange

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/store"
)

// maxForgottenSubjects bounds the subjects that forgets remembers one by
// one; past it, a forget of one subject forgets every subject.
const maxForgottenSubjects = 4096

// forgets makes cached hub decisions stale when what they were made from
// changes: decisions and revocation are one system. Every review takes a
// sequence number when it starts (next), and its cached result keeps it; a
// change of hub RBAC, or of one subject's hub ServiceAccount, takes the
// next number too. A result whose review started before a change that
// concerns it is stale, whatever its TTL says, so that no call is served
// from it, and a review in flight when the change came (a refresh ahead
// of time, a concurrent miss) cannot store a decision that looks fresh.
type forgets struct {
	clock clock.PassiveClock
	// keep is how long a subject's forget must be remembered: until every
	// result of a review started before it has ended (the longest TTL,
	// plus the review's own time).
	keep time.Duration

	seq  atomic.Uint64
	rbac atomic.Uint64 // the number of the last change of hub RBAC

	mu       sync.RWMutex
	all      uint64                      // the number of the last forget of every subject
	allAt    time.Time                   // and when it was
	subjects map[string]forgottenSubject // by username
}

type forgottenSubject struct {
	seq uint64
	at  time.Time
}

func newForgets(clk clock.PassiveClock, keep time.Duration) *forgets {
	return &forgets{clock: clk, keep: keep, subjects: map[string]forgottenSubject{}}
}

// next returns the number of a review that starts now.
func (f *forgets) next() uint64 { return f.seq.Add(1) }

// rbacChanged makes every authorization decision reviewed so far stale.
func (f *forgets) rbacChanged() { f.rbac.Store(f.seq.Add(1)) }

// subjectChanged makes every authentication and authorization decision
// about username reviewed so far stale.
func (f *forgets) subjectChanged(username string) {
	now := f.clock.Now()
	f.mu.Lock()
	defer f.mu.Unlock()
	seq := f.seq.Add(1)
	for u, s := range f.subjects {
		if now.Sub(s.at) > f.keep {
			delete(f.subjects, u)
		}
	}
	if len(f.subjects) >= maxForgottenSubjects {
		f.all, f.allAt, f.subjects = seq, now, map[string]forgottenSubject{}
		return
	}
	f.subjects[username] = forgottenSubject{seq: seq, at: now}
}

// subjectStale reports whether a decision about username whose review
// started at seq predates a change of that subject.
func (f *forgets) subjectStale(username string, seq uint64) bool {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return seq < f.all || seq < f.subjects[username].seq
}

// subjectChangedRecently reports whether username's hub ServiceAccount
// changed within keep: long enough for the hub's own token cache to have
// let go of a deleted account's tokens.
func (f *forgets) subjectChangedRecently(username string) bool {
	now := f.clock.Now()
	f.mu.RLock()
	defer f.mu.RUnlock()
	if s, ok := f.subjects[username]; ok && now.Sub(s.at) <= f.keep {
		return true
	}
	return f.all != 0 && now.Sub(f.allAt) <= f.keep
}

// authorizationStale reports whether an authorization decision about
// username whose review started at seq predates a change of hub RBAC or of
// the subject.
func (f *forgets) authorizationStale(username string, seq uint64) bool {
	return seq < f.rbac.Load() || f.subjectStale(username, seq)
}

// RBACChanged makes every cached SubjectAccessReview decision stale: hub
// RBAC changed, and a decision reviewed before may allow what RBAC no
// longer does. The next call of each consumer waits for a review of its
// own. The broker calls it on every change its RBAC informers see, on
// every replica; grants.Decisions.
func (s *Service) RBACChanged() { s.forgets.rbacChanged() }

// SubjectChanged makes every cached TokenReview and SubjectAccessReview
// decision about the hub user username stale: its hub ServiceAccount was
// deleted or created again, and a token of the old one may still look
// authenticated in the cache. The broker calls it on every such change its
// informer sees, on every replica; grants.Decisions.
func (s *Service) SubjectChanged(username string) { s.forgets.subjectChanged(username) }

// maxStaleRounds bounds how often freshDecision reviews again a decision
// that went stale while it was being reviewed.
const maxStaleRounds = 3

// freshDecision is c.Do for key, except that a result that stale rejects,
// one reviewed before a change of what it was decided from, is dropped and
// reviewed again, up to maxStaleRounds times.
func freshDecision[V any](ctx context.Context, c *store.Cache[cacheKey, V], key cacheKey, stale func(V) bool,
	fetch func(context.Context) (V, time.Time, error)) (v V, hit bool, err error) {
	for range maxStaleRounds {
		if v, hit, err = c.Do(ctx, key, fetch); err != nil || !stale(v) {
			return v, hit, err
		}
		c.Remove(key)
	}
	var zero V
	return zero, false, fmt.Errorf("hub RBAC or ServiceAccounts kept changing while the broker reviewed the call; try again: %w", errdefs.ErrUnavailable)
}
