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
// lists the grants and deletes those whose GrantExpirationAnnotation has
// passed. The sweep needs list because the agent's timers die with it: the
// grants of an agent that crashed or restarted are known only to the spoke
// API server, and a grant that outlives its token only clutters (its token
// is already invalid), but would otherwise stay forever. So no grant lives
// longer than its token plus one CollectInterval while an agent runs.
//
// Run returns nil when ctx ends. Failures to list or delete are logged and
// retried at the next sweep.
func (m *Minter) Run(ctx context.Context) error {
	m.mu.Lock()
	m.runCtx = ctx
	m.mu.Unlock()
	defer func() {
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
		select {
		case <-ctx.Done():
			return nil
		case <-ticker.C():
		}
	}
}

// sweep deletes every grant whose token has expired.
func (m *Minter) sweep(ctx context.Context) {
	grants, err := m.grants.List(ctx)
	if err != nil {
		if ctx.Err() == nil {
			m.log.Error(err, "failed to list grants; retrying at the next sweep", "interval", m.interval.String())
		}
		return
	}
	now := m.clock.Now()
	maxLifetime := time.Duration(m.maxSeconds) * time.Second
	for i := range grants {
		g := &grants[i]
		// The API server filters by label and type; check again, so a
		// store that does not can never make the agent delete another
		// Secret.
		if g.Type != GrantType || g.Labels[GrantLabel] != "true" {
			continue
		}
		if exp := grantExpiration(g, maxLifetime); !exp.After(now) {
			m.collect(ctx, g.Namespace, g.Name, g.UID, "sweep")
		}
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

// collect deletes the grant namespace/name of UID uid, whose token has
// expired.
func (m *Minter) collect(ctx context.Context, namespace, name string, uid types.UID, why string) {
	err := m.grants.Delete(ctx, namespace, name, uid)
	switch {
	case err == nil:
		m.log.Info("collected expired grant", "grant", namespace+"/"+name, "by", why)
	case apierrors.IsNotFound(err) || apierrors.IsConflict(err):
		// Already gone, or replaced by another object of that name.
	case ctx.Err() == nil:
		m.log.Error(err, "failed to delete expired grant; retrying at the next sweep", "grant", namespace+"/"+name)
	}
}
