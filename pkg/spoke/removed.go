package spoke

import (
	"slices"
	"sync"
	"time"

	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// A grant's removal is told once, on the streams open when the agent sees
// it. A broker replica whose stream was down then (a reconnect, a queue
// overflow, a drain) would never learn of it: a hello tells the live
// grants, and the broker never drops a grant because a hello leaves it out,
// since another agent of the ClusterProfile may hold it. Until the
// grant's token expires, that replica would answer exchanges with the dead
// token from its cache. So the Minter remembers the removals of grants
// whose tokens have not expired, and the Client tells them after every
// hello (Removed).

// maxRemembered bounds the removals a Minter remembers: those expiring
// last are kept. Every removal is remembered, the grants collected at
// their expiry too, but those expire first, so they are forgotten first
// and never told; a remembered removal costs about a hundred bytes.
const maxRemembered = 4096

// removals holds credential ids by the time their tokens expire. Its zero
// value is ready. It reads no clock when told of a removal: grant events
// may come from a clock's own timer.
type removals struct {
	mu sync.Mutex
	by map[string]time.Time
}

// add remembers id until expires.
func (r *removals) add(id string, expires time.Time) {
	if id == "" {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.by == nil {
		r.by = map[string]time.Time{}
	}
	if _, ok := r.by[id]; !ok && len(r.by) >= maxRemembered {
		first := ""
		for k, at := range r.by {
			if first == "" || at.Before(r.by[first]) {
				first = k
			}
		}
		if !expires.After(r.by[first]) {
			return
		}
		delete(r.by, first)
	}
	r.by[id] = expires
}

// list returns the credential ids whose tokens have not expired at now,
// sorted. It forgets the others, and keeps none longer than maxLifetime
// from now, whatever its grant said.
func (r *removals) list(now time.Time, maxLifetime time.Duration) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	latest := now.Add(maxLifetime)
	out := make([]string, 0, len(r.by))
	for id, at := range r.by {
		switch {
		case !at.After(now):
			delete(r.by, id)
			continue
		case at.After(latest):
			r.by[id] = latest
		}
		out = append(out, id)
	}
	slices.Sort(out)
	return out
}

// Removed returns the credential ids of the grants the Minter saw removed
// while their tokens were live, until those tokens expire (at most
// maxRemembered of them), sorted. The tunnel's Client sends them after
// every hello.
func (m *Minter) Removed() []string {
	return m.removed.list(m.clock.Now(), time.Duration(m.maxSeconds)*time.Second)
}

// publishRemoved remembers the removal of credential id id, whose token
// expires at expires, and tells subscribers of it.
func (m *Minter) publishRemoved(id string, expires time.Time) {
	m.removed.add(id, expires)
	m.publish(&credbrokerv1alpha1.GrantUpdate{Removed: []string{id}})
}
