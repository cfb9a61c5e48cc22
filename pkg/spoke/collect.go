package spoke

import (
	"context"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
)

// Run collects grants until ctx ends: it deletes each grant Mint creates
// when its token expires, and every CollectInterval, starting at once, it
// reads the grants from GrantCache and deletes those whose
// GrantExpirationAnnotation has passed. The sweep is needed because the
// agent's timers die with it: the grants of an agent that crashed or
// restarted are known only to the spoke API server (and so to the grant
// informer, which lists them when it starts), and a grant that outlives its
// token only clutters (its token is already invalid), but would otherwise
// stay forever. So no grant lives longer than its token plus one
// CollectInterval while an agent runs. The sweep costs no API call but the
// deletes.
//
// Run also revokes grants that a ServiceAccount's policy no longer allows:
// those of each ServiceAccount that PolicyChanged or a new grant queues
// (see Reconcile), and, at each sweep, every live grant of a ServiceAccount
// whose policy, as the informer's cache has it, no longer allows it. The
// first sweep is what revokes after a change an agent missed while it was
// down, so start Run once both informers have synced. A grant whose
// ServiceAccount is gone is left to expire: its token died with the
// ServiceAccount.
//
// Run also deletes the grants that someone other than the agent changed
// (see GrantEvents), as GrantEvents queues them, and at each sweep those
// whose delete failed or that it found changed.
//
// Run returns nil when ctx ends; call it once. Failures to delete are
// logged and retried at the next sweep, or, for a queued ServiceAccount or
// changed grant, with backoff.
func (m *Minter) Run(ctx context.Context) error {
	queue := newPolicyQueue()
	changed := newChangedQueue()
	m.mu.Lock()
	m.runCtx = ctx
	m.queue = queue
	m.mu.Unlock()
	m.setChangedQueue(changed)
	stopPool := m.startPool(ctx)
	defer stopPool()
	reconciled := make(chan struct{})
	go func() {
		defer close(reconciled)
		work(ctx, queue, func(ctx context.Context, key types.NamespacedName) error {
			return m.Reconcile(ctx, key.Namespace, key.Name)
		}, func(err error, key types.NamespacedName) {
			m.log.Error(err, "failed to revoke the grants a ServiceAccount's policy no longer allows; retrying", "serviceAccount", key.String())
		})
	}()
	deleted := make(chan struct{})
	go func() {
		defer close(deleted)
		work(ctx, changed, m.deleteChanged, func(err error, ref grantRef) {
			m.log.Error(err, "failed to delete a grant that someone other than the agent changed; retrying",
				"grant", ref.namespace+"/"+ref.name)
		})
	}()
	defer func() {
		m.setChangedQueue(nil)
		changed.ShutDown()
		<-deleted
		queue.ShutDown()
		<-reconciled
		m.mu.Lock()
		defer m.mu.Unlock()
		m.runCtx = nil
		for uid, t := range m.timers {
			t.Stop()
			delete(m.timers, uid)
		}
	}()
	ticker := m.clock.NewTicker(m.interval)
	defer ticker.Stop()
	for {
		m.sweep(ctx)
		m.queueAllChanged()
		select {
		case <-ctx.Done():
			return nil
		case <-ticker.C():
		}
	}
}

// sweep deletes every grant whose token has expired, and every other grant
// whose ServiceAccount's policy no longer allows it; and queues for
// deletion every grant someone other than the agent changed.
func (m *Minter) sweep(ctx context.Context) {
	now := m.clock.Now()
	maxLifetime := m.maxLifetime()
	for _, obj := range m.grantCache.List() {
		g, ok := obj.(*corev1.Secret)
		// The informer selects by type; check again, so a cache that does
		// not can never make the agent delete another Secret.
		if !ok || !isGrant(g) {
			continue
		}
		if m.checkSeen(g) {
			continue
		}
		if exp := grantExpiration(g, maxLifetime); !exp.After(now) {
			// A grant this agent minted has its own timer, which fires at
			// the same time; leave it to the timer.
			if !m.hasTimer(g.UID) {
				m.collect(ctx, g.Namespace, g.Name, g.UID, "sweep")
			}
			continue
		}
		// A ServiceAccount that is gone, or not in the cache, revokes
		// nothing: its tokens died with it.
		sa, err := m.sas.ServiceAccounts(g.Namespace).Get(g.Annotations[GrantServiceAccountAnnotation])
		if err != nil {
			continue
		}
		if err := m.revokeDisallowed(ctx, sa, g); err != nil && ctx.Err() == nil {
			m.log.Error(err, "failed to revoke a grant its ServiceAccount no longer allows; retrying at the next sweep", "interval", m.interval.String())
		}
	}
}

// hasTimer reports whether a timer of this agent will delete the grant of
// UID uid.
func (m *Minter) hasTimer(uid types.UID) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	_, ok := m.timers[uid]
	return ok
}

// stopTimer stops the timer of the grant of UID uid, if any: the grant is
// gone.
func (m *Minter) stopTimer(uid types.UID) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if t, ok := m.timers[uid]; ok {
		t.Stop()
		delete(m.timers, uid)
	}
}

// track arranges for grant to be deleted when its token expires at exp.
func (m *Minter) track(grant *corev1.Secret, exp time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	ctx := m.runCtx
	if ctx == nil {
		return // Run's first sweep collects it
	}
	ns, name, uid := grant.Namespace, grant.Name, grant.UID
	m.timers[uid] = m.clock.AfterFunc(exp.Sub(m.clock.Now()), func() {
		m.mu.Lock()
		delete(m.timers, uid)
		m.mu.Unlock()
		m.collect(ctx, ns, name, uid, "expiry")
	})
}

// gone reports whether a grant delete failed only because the grant no
// longer exists: it is not found, or the UID precondition found another
// object of that name.
func gone(err error) bool {
	return apierrors.IsNotFound(err) || apierrors.IsConflict(err)
}

// collect deletes the grant namespace/name of UID uid, whose token has
// expired.
func (m *Minter) collect(ctx context.Context, namespace, name string, uid types.UID, why string) {
	err := m.grants.Delete(ctx, namespace, name, uid)
	switch {
	case err == nil:
		m.log.Info("collected expired grant", "grant", namespace+"/"+name, "by", why)
	case gone(err):
	case ctx.Err() == nil:
		m.log.Error(err, "failed to delete expired grant; retrying at the next sweep", "grant", namespace+"/"+name)
	}
}
