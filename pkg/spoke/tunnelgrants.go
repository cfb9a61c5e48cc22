package spoke

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// The Minter is also the agent's side of revocation over the tunnel (the
// tunnel package's Grants interface): it reports the grants in GrantCache to
// the brokers, in each stream's hello and as they change, and deletes the
// grants a broker asks it to revoke.

// maxLookups bounds the credential ids of one RevokeRequest that Revoke
// looks up with the API server because the cache does not know them.
const maxLookups = 256

// defaultRevokeReason is logged for a RevokeRequest without a reason.
const defaultRevokeReason = "revoked by the broker"

// GrantEvents returns the event handler to register on the grant informer
// whose indexer is GrantCache. It tells Subscribe's subscribers of every
// grant that gains a credential id, changes or is deleted; stops the expiry
// timer of a deleted grant; and queues the ServiceAccount of every new
// grant, and of every pooled grant when it is claimed, for Reconcile, so
// that a policy change that reached the agent before the grant (or its
// claim) did still revokes it.
//
// A grant that differs from what the agent writes (see tamper.go) was
// changed by someone else: it queues the grant for Run to delete, which
// revokes its token, and tells subscribers nothing of the change; they
// learn of the grant's removal, under the credential id the agent had
// recorded, once it is deleted. A pooled grant deleted before its claim
// landed is told removed under the credential id of its claim. A grant
// being deleted is never told as added.
func (m *Minter) GrantEvents() cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			g, ok := obj.(*corev1.Secret)
			if !ok || !isGrant(g) || m.checkSeen(g) {
				return
			}
			if !unclaimed(g) {
				m.claims.forget(g.UID)
			}
			if sa := g.Annotations[GrantServiceAccountAnnotation]; sa != "" && !unclaimed(g) {
				m.enqueueServiceAccount(g.Namespace, sa)
			}
			if g.Annotations[GrantCredentialIDAnnotation] != "" && g.DeletionTimestamp == nil {
				m.publish(&credbrokerv1alpha1.GrantUpdate{Added: []*credbrokerv1alpha1.Grant{m.toGrant(g)}})
			}
		},
		UpdateFunc: func(oldObj, newObj any) {
			old, ok1 := oldObj.(*corev1.Secret)
			now, ok2 := newObj.(*corev1.Secret)
			if !ok1 || !ok2 || !isGrant(now) || m.checkUpdate(old, now) {
				return
			}
			if unclaimed(old) && !unclaimed(now) {
				// A pooled grant claimed: its token's owner is known now,
				// so a policy change that reached the agent first revokes
				// it.
				m.claims.forget(now.UID)
				m.enqueueServiceAccount(now.Namespace, now.Annotations[GrantServiceAccountAnnotation])
			}
			oldID, newID := "", ""
			if isGrant(old) {
				oldID = old.Annotations[GrantCredentialIDAnnotation]
			}
			if isGrant(now) {
				newID = now.Annotations[GrantCredentialIDAnnotation]
			}
			u := &credbrokerv1alpha1.GrantUpdate{}
			if oldID != "" && oldID != newID {
				u.Removed = []string{oldID}
			}
			if newID != "" && now.DeletionTimestamp == nil {
				g := m.toGrant(now)
				// A resync, or a change to nothing the broker sees, sends
				// nothing.
				if oldID != newID || !proto.Equal(g, m.toGrant(old)) {
					u.Added = []*credbrokerv1alpha1.Grant{g}
				}
			}
			if len(u.Added) > 0 || len(u.Removed) > 0 {
				m.publish(u)
			}
		},
		DeleteFunc: func(obj any) {
			if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = tomb.Obj
			}
			g, ok := obj.(*corev1.Secret)
			if !ok {
				return
			}
			m.stopTimer(g.UID)
			m.forgetPooled(g.UID)
			claimed := m.claims.take(g.UID)
			id, expires := g.Annotations[GrantCredentialIDAnnotation], m.expiration(g)
			if rec, changed := m.forgetChanged(g.UID); changed {
				id, expires = rec.credentialID, rec.expires
			}
			if id == "" && claimed != nil {
				// A pooled grant deleted before its claim landed.
				id, expires = claimed.Annotations[GrantCredentialIDAnnotation], m.expiration(claimed)
			}
			if id != "" && isGrant(g) {
				m.publishRemoved(id, expires)
			}
		},
	}
}

// enqueueServiceAccount queues the ServiceAccount namespace/name for
// Reconcile.
func (m *Minter) enqueueServiceAccount(namespace, name string) {
	m.enqueue(types.NamespacedName{Namespace: namespace, Name: name})
}

// publish calls every subscriber with its own copy of u.
func (m *Minter) publish(u *credbrokerv1alpha1.GrantUpdate) {
	m.subMu.RLock()
	defer m.subMu.RUnlock()
	for fn := range m.subscribers {
		(*fn)(proto.CloneOf(u))
	}
}

// Subscribe calls fn with every change to the grants in GrantCache, as the
// grant informer reports it, until unsubscribe is called: a grant that
// gains a credential id (or changes) is added, a deleted grant's credential
// id is removed. fn is called on the informer's goroutine, and on a
// failed claim's, so it must not block and must be safe to call
// concurrently.
func (m *Minter) Subscribe(fn func(*credbrokerv1alpha1.GrantUpdate)) (unsubscribe func()) {
	m.subMu.Lock()
	defer m.subMu.Unlock()
	key := &fn
	m.subscribers[key] = struct{}{}
	return func() {
		m.subMu.Lock()
		defer m.subMu.Unlock()
		delete(m.subscribers, key)
	}
}

// Snapshot returns every grant in GrantCache that has a credential id,
// ordered by credential id, whatever ClusterProfile it records: the broker
// keeps those of the ClusterProfile it admitted the stream for. It leaves
// out the grants someone else changed, which are being deleted, and every
// grant being deleted, whose token dies within a minute anyway.
func (m *Minter) Snapshot() []*credbrokerv1alpha1.Grant {
	var out []*credbrokerv1alpha1.Grant
	for _, obj := range m.grantCache.List() {
		g, ok := obj.(*corev1.Secret)
		if !ok || !isGrant(g) || g.Annotations[GrantCredentialIDAnnotation] == "" || g.DeletionTimestamp != nil {
			continue
		}
		if _, changed := m.changedRecord(g.UID); changed || foreignChange(g, m.maxLifetime()) != "" {
			continue
		}
		out = append(out, m.toGrant(g))
	}
	slices.SortFunc(out, func(a, b *credbrokerv1alpha1.Grant) int {
		return cmp.Or(cmp.Compare(a.GetCredentialId(), b.GetCredentialId()),
			cmp.Compare(a.GetSecret().GetNamespace(), b.GetSecret().GetNamespace()),
			cmp.Compare(a.GetSecret().GetName(), b.GetSecret().GetName()))
	})
	return out
}

// toGrant returns what the grant g records, as the broker sees it.
func (m *Minter) toGrant(g *corev1.Secret) *credbrokerv1alpha1.Grant {
	a := g.Annotations
	out := &credbrokerv1alpha1.Grant{
		CredentialId: a[GrantCredentialIDAnnotation],
		ClusterUid:   a[GrantClusterProfileUIDAnnotation],
		Subject: &credbrokerv1alpha1.Subject{
			Username: a[GrantHubUserAnnotation],
			Uid:      a[GrantHubUIDAnnotation],
			Groups:   splitGroups(a[GrantHubGroupsAnnotation]),
		},
		ServiceAccount: &credbrokerv1alpha1.ObjectReference{Namespace: g.Namespace, Name: a[GrantServiceAccountAnnotation]},
		Audiences:      grantAudiences(g),
		ExpirationTime: timestamppb.New(m.expiration(g)),
		Secret:         &credbrokerv1alpha1.ObjectReference{Namespace: g.Namespace, Name: g.Name},
		TokenSha256:    grantTokenSHA256(g),
	}
	if ns, name, ok := strings.Cut(a[GrantClusterProfileAnnotation], "/"); ok {
		out.Cluster = &credbrokerv1alpha1.ObjectReference{Namespace: ns, Name: name}
	}
	return out
}

// Revoke deletes the grants whose credential id req names and whose
// GrantClusterProfileAnnotation is cluster, the ClusterProfile the
// request's stream was admitted for: a broker that admitted the agent for
// one ClusterProfile cannot revoke the grants minted through another. It logs each revocation with req's reason.
//
// It answers the credential ids whose grants are now gone: deleted now, or
// found neither in GrantCache nor, asked at once, on the API server. An id
// whose grant records another ClusterProfile, or whose delete failed, is
// left out, and the broker retries it. Revoke returns an error (wrapping
// ErrUnavailable) only when no id is gone and some delete or lookup failed,
// so a partial failure still reports what succeeded; and ErrPermissionDenied
// when cluster is zero. At most 256 ids unknown to
// the cache are looked up per request; the others are left out.
func (m *Minter) Revoke(ctx context.Context, admitted fleet.ClusterRef, req *credbrokerv1alpha1.RevokeRequest) (*credbrokerv1alpha1.RevokeResponse, error) {
	cluster := profileName(admitted)
	if cluster == "" {
		return nil, fmt.Errorf("revoke request came through no broker stream admitted for a ClusterProfile: %w", errdefs.ErrPermissionDenied)
	}
	reason := req.GetReason()
	if reason == "" {
		reason = defaultRevokeReason
	}
	var (
		gone    []string
		errs    []error
		lookups int
		seen    = map[string]bool{}
	)
	for _, id := range req.GetCredentialIds() {
		if id == "" || seen[id] {
			continue
		}
		seen[id] = true
		grants := m.cachedGrantsOf(id)
		if len(grants) == 0 {
			if lookups++; lookups > maxLookups {
				continue
			}
			var err error
			if grants, err = m.storedGrantsOf(ctx, id); err != nil {
				errs = append(errs, err)
				continue
			}
		}
		allGone := true
		for _, g := range grants {
			if _, recorded := m.recorded(g); recorded != cluster {
				m.log.Info("refused to revoke a grant of another ClusterProfile",
					fleet.LogCredentialID, id, "grant", g.Namespace+"/"+g.Name,
					"grantClusterProfile", recorded, fleet.LogAdmittedFor, cluster)
				allGone = false
				continue
			}
			if err := m.revokeGrant(ctx, g, reason); err != nil {
				errs = append(errs, err)
				allGone = false
			}
		}
		if allGone {
			gone = append(gone, id)
		}
	}
	if len(errs) > 0 {
		err := errors.Join(errs...)
		if len(gone) == 0 {
			return nil, fmt.Errorf("revoke grants: %w", err)
		}
		m.log.Error(err, "failed to revoke some grants; the broker retries them", "revoked", len(gone))
	}
	return &credbrokerv1alpha1.RevokeResponse{CredentialIds: gone}, nil
}

// cachedGrantsOf returns the grants in GrantCache that record credential
// id id, as the agent wrote it: a grant someone else changed counts under
// the id the agent had recorded.
func (m *Minter) cachedGrantsOf(id string) []*corev1.Secret {
	// A grant claimed a moment ago, whose claim the cache does not show
	// yet, counts as the agent claimed it.
	out := append(m.changedWith(id), m.claims.with(id)...)
	objs, err := m.grantCache.ByIndex(GrantCredentialIDIndex, id)
	if err != nil {
		return out // the index exists: New checks
	}
	for _, obj := range objs {
		if g, ok := obj.(*corev1.Secret); ok && isGrant(g) && g.Annotations[GrantCredentialIDAnnotation] == id {
			if _, changed := m.changedRecord(g.UID); !changed {
				out = append(out, g)
			}
		}
	}
	return out
}

// changedWith returns the grants in GrantCache that someone else changed
// and whose credential id, as the agent wrote it, is id.
func (m *Minter) changedWith(id string) []*corev1.Secret {
	m.changes.mu.Lock()
	var refs []grantRef
	for uid, rec := range m.changes.changed {
		if rec.credentialID == id {
			refs = append(refs, grantRef{namespace: rec.namespace, name: rec.name, uid: uid})
		}
	}
	m.changes.mu.Unlock()
	var out []*corev1.Secret
	for _, r := range refs {
		obj, ok, err := m.grantCache.GetByKey(r.namespace + "/" + r.name)
		if err != nil || !ok {
			continue
		}
		if g, ok := obj.(*corev1.Secret); ok && g.UID == r.uid && isGrant(g) {
			out = append(out, g)
		}
	}
	return out
}

// storedGrantsOf asks the API server for the grants that record credential
// id id: the cache may not have seen a grant recorded a moment ago.
func (m *Minter) storedGrantsOf(ctx context.Context, id string) ([]*corev1.Secret, error) {
	list, err := m.grants.ListCredential(ctx, id)
	if err != nil {
		return nil, fmt.Errorf("look up the grant of credential %s on the spoke API server: %v: %w", id, err, errdefs.ErrUnavailable)
	}
	var out []*corev1.Secret
	for i := range list {
		if g := &list[i]; isGrant(g) && g.Annotations[GrantCredentialIDAnnotation] == id {
			if recorded, _ := m.recorded(g); recorded == id {
				out = append(out, g)
			}
		}
	}
	return out, nil
}

// revokeGrant deletes grant, if its UID is still the same, and logs it.
// A grant already gone is no error.
func (m *Minter) revokeGrant(ctx context.Context, grant *corev1.Secret, reason string) error {
	ref := grant.Namespace + "/" + grant.Name
	err := m.grants.Delete(ctx, grant.Namespace, grant.Name, grant.UID)
	switch {
	case gone(err):
		m.stopTimer(grant.UID)
		return nil
	case err != nil:
		return fmt.Errorf("revoke grant %s of credential %s: %v: %w",
			ref, grant.Annotations[GrantCredentialIDAnnotation], err, errdefs.ErrUnavailable)
	}
	m.stopTimer(grant.UID)
	id, _ := m.recorded(grant)
	m.log.Info("revoked grant",
		"grant", ref,
		fleet.LogCredentialID, id,
		fleet.LogSubject, grant.Annotations[GrantHubUserAnnotation],
		"serviceAccount", grant.Namespace+"/"+grant.Annotations[GrantServiceAccountAnnotation],
		"audiences", grantAudiences(grant),
		fleet.LogReason, reason,
	)
	return nil
}
