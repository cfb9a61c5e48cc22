package spoke

import (
	"context"
	"errors"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/workqueue"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
)

// newPolicyQueue returns the queue of ServiceAccounts whose policy changed:
// a burst of changes to one ServiceAccount is reconciled once, and a failed
// reconcile is retried with the controllers' usual backoff.
func newPolicyQueue() workqueue.TypedRateLimitingInterface[types.NamespacedName] {
	return workqueue.NewTypedRateLimitingQueueWithConfig(
		workqueue.DefaultTypedControllerRateLimiter[types.NamespacedName](),
		workqueue.TypedRateLimitingQueueConfig[types.NamespacedName]{Name: "credbroker-spoke-policy"},
	)
}

// PolicyChanged tells the Minter that the spoke ServiceAccount old is now
// now; the agent calls it from its ServiceAccount informer's update handler.
// When AllowedSubjectsAnnotation or AllowedAudiencesAnnotation changed, it
// queues the ServiceAccount, and Run revokes the grants that its new policy
// no longer allows (see Reconcile). It returns at once: the work is done off
// the informer's goroutine.
func (m *Minter) PolicyChanged(old, now *corev1.ServiceAccount) {
	if old == nil || now == nil {
		return
	}
	if old.Annotations[AllowedSubjectsAnnotation] == now.Annotations[AllowedSubjectsAnnotation] &&
		old.Annotations[AllowedAudiencesAnnotation] == now.Annotations[AllowedAudiencesAnnotation] {
		return
	}
	m.enqueue(types.NamespacedName{Namespace: now.Namespace, Name: now.Name})
}

// enqueue queues the ServiceAccount key for Reconcile. Before Run starts,
// it does nothing: Run's first sweep checks every grant.
func (m *Minter) enqueue(key types.NamespacedName) {
	m.mu.Lock()
	q := m.queue
	m.mu.Unlock()
	if q != nil {
		q.Add(key) // a no-op once Run has shut the queue down
	}
}

// Reconcile revokes, by deleting them, the grants of the spoke
// ServiceAccount namespace/name that its policy, as the informer's cache
// has it now, no longer allows: those whose hub user its
// AllowedSubjectsAnnotation no longer lists, by name or by one of the hub
// groups the grant recorded, and those with an audience
// its AllowedAudiencesAnnotation no longer lists. It applies the checks Mint
// applies. It reads that ServiceAccount's grants from GrantCache's index,
// at no API cost. A ServiceAccount
// that is gone needs nothing: its tokens died with it, and Run collects its
// grants when they expire. Errors wrap ErrUnavailable.
func (m *Minter) Reconcile(ctx context.Context, namespace, name string) error {
	ref := namespace + "/" + name
	sa, err := m.sas.ServiceAccounts(namespace).Get(name)
	switch {
	case apierrors.IsNotFound(err):
		return nil
	case err != nil:
		return fmt.Errorf("read spoke ServiceAccount %s from the agent's cache: %v: %w", ref, err, errdefs.ErrUnavailable)
	}
	grants, err := m.grantCache.ByIndex(GrantServiceAccountIndex, ref)
	if err != nil {
		return fmt.Errorf("read the grants of spoke ServiceAccount %s from the agent's cache: %v: %w", ref, err, errdefs.ErrUnavailable)
	}
	var errs []error
	for _, obj := range grants {
		g, ok := obj.(*corev1.Secret)
		// The informer selects by type; check again, so that a cache that
		// does not can never make the agent delete another Secret.
		if !ok || !isGrant(g) || g.Namespace != namespace || g.Annotations[GrantServiceAccountAnnotation] != name {
			continue
		}
		// What a grant that someone else changed says is not the agent's:
		// Run deletes it as changed.
		if _, changed := m.changedRecord(g.UID); changed {
			continue
		}
		if err := m.revokeDisallowed(ctx, sa, g); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// isGrant reports whether s is a grant: of GrantType. A Secret's type
// cannot change, so no one can make a grant look like anything else, or
// another Secret look like a grant; its labels can, and say nothing here.
func isGrant(s *corev1.Secret) bool {
	return s.Type == GrantType
}

// grantAudiences returns the audiences grant's token was minted for.
func grantAudiences(grant *corev1.Secret) []string {
	var audiences []string
	for a := range strings.SplitSeq(grant.Annotations[GrantAudiencesAnnotation], ",") {
		if a != "" {
			audiences = append(audiences, a)
		}
	}
	return audiences
}

// revokeDisallowed deletes grant, of ServiceAccount sa, if sa's policy no
// longer allows it.
func (m *Minter) revokeDisallowed(ctx context.Context, sa *corev1.ServiceAccount, grant *corev1.Secret) error {
	if unclaimed(grant) {
		// No token of it is handed out yet; its claim queues a Reconcile.
		return nil
	}
	why := disallowed(sa, grant)
	if why == "" {
		return nil
	}
	ref := grant.Namespace + "/" + grant.Name
	err := m.grants.Delete(ctx, grant.Namespace, grant.Name, grant.UID)
	switch {
	case gone(err):
		return nil
	case err != nil:
		return fmt.Errorf("revoke grant %s, which spoke ServiceAccount %s/%s no longer allows: %v: %w",
			ref, sa.Namespace, sa.Name, err, errdefs.ErrUnavailable)
	}
	m.stopTimer(grant.UID)
	m.log.Info("revoked grant",
		"grant", ref,
		fleet.LogCredentialID, grant.Annotations[GrantCredentialIDAnnotation],
		fleet.LogSubject, grant.Annotations[GrantHubUserAnnotation],
		"serviceAccount", sa.Namespace+"/"+sa.Name,
		"audiences", grantAudiences(grant),
		fleet.LogReason, why,
	)
	return nil
}

// work calls do with each key queue holds until it shuts down, and fail
// with each error of do but those after ctx ended; a key whose do failed
// is retried with the queue's backoff.
func work[K comparable](ctx context.Context, queue workqueue.TypedRateLimitingInterface[K], do func(context.Context, K) error, fail func(error, K)) {
	for {
		key, shutdown := queue.Get()
		if shutdown {
			return
		}
		err := do(ctx, key)
		switch {
		case err == nil || ctx.Err() != nil:
			queue.Forget(key)
		default:
			fail(err, key)
			queue.AddRateLimited(key)
		}
		queue.Done(key)
	}
}
