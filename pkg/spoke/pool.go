package spoke

import (
	"context"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/workqueue"
)

// The grant pool takes the grant's creation off a mint's answer path. For
// each ServiceAccount it has minted for, Run keeps up to Config.PoolSize
// pooled grants: grants created ahead that name the ServiceAccount and
// nothing else, that no token is bound to. A mint takes one, binds its
// token to it, answers, and then claims it: one patch writes the owner,
// the scope, the credential id and the expiry (claim.go). A pooled grant
// is used only by the agent that created it, only while its informer shows
// it as the agent wrote it, and only while it is young (poolGrantMaxAge).

const (
	// DefaultPoolSize is the agent's default Config.PoolSize.
	DefaultPoolSize = 2
	// poolGrantTTL is how long a pooled grant lives unclaimed: its
	// GrantExpirationAnnotation, after which the sweep collects it. It
	// bounds how long a token whose claim never landed (the agent died in
	// between) outlives the agent: its grant is collected, which revokes
	// it.
	poolGrantTTL = 10 * time.Minute
	// poolGrantMaxAge is the age after which a pooled grant is no longer
	// used, so that its claim lands long before its sweep.
	poolGrantMaxAge = poolGrantTTL / 2
	// poolClockSkew is how far the agent's clock may run ahead of the API
	// server's, as a pooled grant's expiry is judged against its
	// creationTimestamp.
	poolClockSkew = time.Minute
)

// pooledAnnotations are the annotations newGrantOf writes on a pooled
// grant, and the only ones it carries until it is claimed.
var pooledAnnotations = []string{GrantServiceAccountAnnotation, GrantExpirationAnnotation}

// pooledGrant is a grant of the pool, as Create returned it.
type pooledGrant struct {
	grant   *corev1.Secret
	created time.Time
}

// grantPool holds the pooled grants of each ServiceAccount and the queue
// of the ServiceAccounts to refill. Its zero size disables it.
type grantPool struct {
	size int

	mu    sync.Mutex
	ready map[types.NamespacedName][]pooledGrant
	// created holds the UIDs of the pooled grants this agent created,
	// until their deletion: only their claims must be the agent's own
	// (checkUpdate). Another replica of the agent claims the grants it
	// pooled itself.
	created map[types.UID]struct{}
	// taken counts the pooled grants taken by mints whose claim (or
	// delete) has not returned: Run returns only once they did, so that no
	// answered token is left unclaimed by an agent that stops.
	taken sync.WaitGroup
	// queue is Run's while Run runs; nil otherwise, and then the pool
	// hands out nothing.
	queue workqueue.TypedRateLimitingInterface[types.NamespacedName]
}

// unclaimed reports whether grant is a pooled grant that no mint has
// claimed: it names no hub user.
func unclaimed(grant *corev1.Secret) bool {
	_, ok := grant.Annotations[GrantHubUserAnnotation]
	return !ok
}

// takePooled returns a pooled grant of sa to bind a token to, as the grant
// cache has it, or nil when none is ready; either way it queues sa's pool
// for a refill. Grants that are too old, gone, replaced or changed are
// dropped; those the cache has not shown yet are kept for later.
func (m *Minter) takePooled(sa *corev1.ServiceAccount) *corev1.Secret {
	p := &m.pool
	if p.size == 0 {
		return nil
	}
	key := types.NamespacedName{Namespace: sa.Namespace, Name: sa.Name}
	now := m.clock.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.queue == nil {
		return nil
	}
	p.queue.Add(key)
	var got *corev1.Secret
	entries := p.ready[key]
	keep := entries[:0]
	for _, e := range entries {
		if now.Sub(e.created) >= poolGrantMaxAge {
			continue // the sweep collects it
		}
		cached, seen := m.pooledAsCached(e.grant)
		switch {
		case !seen:
			keep = append(keep, e)
		case cached == nil:
			// Gone, replaced or changed: never bound to.
		case got == nil:
			got = cached
		default:
			keep = append(keep, e)
		}
	}
	p.ready[key] = keep
	if got != nil {
		p.taken.Add(1) // before stop's Wait: p.queue is not nil
	}
	return got
}

// pooledAsCached returns grant as the grant cache has it, if it is still
// the unclaimed grant the agent created and no one changed, or nil if not;
// seen is false when the cache does not show it yet.
func (m *Minter) pooledAsCached(grant *corev1.Secret) (cached *corev1.Secret, seen bool) {
	obj, ok, err := m.grantCache.GetByKey(grant.Namespace + "/" + grant.Name)
	if err != nil || !ok {
		return nil, false
	}
	g, ok := obj.(*corev1.Secret)
	if !ok || g.UID != grant.UID || g.DeletionTimestamp != nil || !isGrant(g) || !unclaimed(g) {
		return nil, true
	}
	if _, changed := m.changedRecord(g.UID); changed || foreignChange(g, m.maxLifetime()) != "" {
		return nil, true
	}
	return g, true
}

// fillPool creates pooled grants for the ServiceAccount key until its pool
// holds PoolSize young ones.
func (m *Minter) fillPool(ctx context.Context, key types.NamespacedName) error {
	p := &m.pool
	for {
		now := m.clock.Now()
		p.mu.Lock()
		young := 0
		for _, e := range p.ready[key] {
			if now.Sub(e.created) < poolGrantMaxAge {
				young++
			}
		}
		p.mu.Unlock()
		if young >= p.size {
			return nil
		}
		grant, err := m.grants.Create(ctx, newGrantOf(key, now.Add(poolGrantTTL)))
		if err == nil && (grant == nil || grant.Name == "" || grant.UID == "") {
			err = errNoNameOrUID
		}
		if err != nil {
			return createGrantError(ctx, key.Namespace, err)
		}
		p.mu.Lock()
		p.ready[key] = append(p.ready[key], pooledGrant{grant: grant, created: now})
		if p.created == nil {
			p.created = map[types.UID]struct{}{}
		}
		p.created[grant.UID] = struct{}{}
		p.mu.Unlock()
	}
}

// startPool makes queue the pool's refill queue, and returns the function
// that stops it, waits for the claims of the pooled grants mints took, and
// deletes, best effort, the pooled grants no mint took.
func (m *Minter) startPool(ctx context.Context) (stop func()) {
	p := &m.pool
	if p.size == 0 {
		return func() {}
	}
	queue := workqueue.NewTypedRateLimitingQueueWithConfig(
		workqueue.DefaultTypedControllerRateLimiter[types.NamespacedName](),
		workqueue.TypedRateLimitingQueueConfig[types.NamespacedName]{Name: "credbroker-spoke-grant-pool"},
	)
	p.mu.Lock()
	p.queue = queue
	p.mu.Unlock()
	done := make(chan struct{})
	go func() {
		defer close(done)
		work(ctx, queue, m.fillPool, func(err error, key types.NamespacedName) {
			m.log.Error(err, "failed to create a pooled grant; retrying", "serviceAccount", key.String())
		})
	}()
	return func() {
		queue.ShutDown()
		<-done
		p.mu.Lock()
		p.queue = nil
		left := p.ready
		p.ready = map[types.NamespacedName][]pooledGrant{}
		p.mu.Unlock()
		p.taken.Wait()
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
		defer cancel()
		for _, entries := range left {
			for _, e := range entries {
				g := e.grant
				if err := m.grants.Delete(ctx, g.Namespace, g.Name, g.UID); err != nil && !gone(err) {
					m.log.Error(err, "failed to delete a pooled grant on shutdown; it is collected when it expires", "grant", g.Namespace+"/"+g.Name)
				}
			}
		}
	}
}

// pooledHere reports whether this agent created the pooled grant of UID
// uid.
func (m *Minter) pooledHere(uid types.UID) bool {
	m.pool.mu.Lock()
	defer m.pool.mu.Unlock()
	_, ok := m.pool.created[uid]
	return ok
}

// forgetPooled drops the grant of UID uid, which is gone, from the pooled
// grants this agent created.
func (m *Minter) forgetPooled(uid types.UID) {
	m.pool.mu.Lock()
	defer m.pool.mu.Unlock()
	delete(m.pool.created, uid)
}
