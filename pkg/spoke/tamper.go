package spoke

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/util/workqueue"

	"github.com/credbroker/credbroker/pkg/fleet"
)

// Only the agent writes a grant (deploy/spoke/admission.yaml refuses
// everyone else). Behind that, the agent checks every grant it sees
// against what it writes itself: a grant that differs (one of its
// credbroker.io/ labels or annotations removed, added or rewritten, a
// finalizer, data), even one being deleted, was changed by someone else, and the agent deletes it, which revokes its
// token. Until the grant is gone the agent goes on answering for it with
// what it had recorded: the brokers hear nothing of the change, revokes
// find it by its recorded credential id and ClusterProfile, and its
// removal is reported only once it is deleted.

// writtenOnce are the annotations that never change once a grant is
// created: the token's owner and scope.
var writtenOnce = []string{
	GrantServiceAccountAnnotation,
	GrantHubUserAnnotation,
	GrantHubUIDAnnotation,
	GrantHubGroupsAnnotation,
	GrantClusterProfileAnnotation,
	GrantClusterProfileUIDAnnotation,
	GrantAudiencesAnnotation,
}

// grantAnnotations are the annotations newGrant writes on every grant:
// the owner and scope, and the token's expiry. Every one of them must be
// present.
var grantAnnotations = append(slices.Clip(writtenOnce), GrantExpirationAnnotation)

// changedGrant is what the agent keeps of a grant that someone else
// changed, until it is deleted: what the agent had recorded on it.
type changedGrant struct {
	namespace, name string
	// credentialID and cluster are the grant's credential id and
	// ClusterProfile as the agent wrote them; credentialID is empty when
	// the agent cannot tell.
	credentialID, cluster string
	// expires is when the grant's token expires, as the agent wrote it;
	// zero when the agent cannot tell.
	expires time.Time
	// change says what differs from what the agent wrote.
	change string
}

// changeTracker holds the grants someone else changed, until they are
// gone, and the queue of their deletes. Its zero value is ready.
type changeTracker struct {
	mu      sync.Mutex
	changed map[types.UID]changedGrant
	// queue is Run's while Run runs; nil otherwise.
	queue workqueue.TypedRateLimitingInterface[grantRef]
}

// grantRef identifies one grant object for the delete queue.
type grantRef struct {
	namespace, name string
	uid             types.UID
}

// newChangedQueue returns the queue of changed grants to delete: a failed
// delete is retried with the controllers' usual backoff.
func newChangedQueue() workqueue.TypedRateLimitingInterface[grantRef] {
	return workqueue.NewTypedRateLimitingQueueWithConfig(
		workqueue.DefaultTypedControllerRateLimiter[grantRef](),
		workqueue.TypedRateLimitingQueueConfig[grantRef]{Name: "credbroker-spoke-changed-grants"},
	)
}

// wantLabels returns the labels the agent writes on grant, given the
// annotations it carries, as newGrant and mintedPatch write them.
func wantLabels(grant *corev1.Secret) map[string]string {
	want := map[string]string{GrantLabel: "true"}
	if sa, ok := grant.Annotations[GrantServiceAccountAnnotation]; ok && len(validation.IsValidLabelValue(sa)) == 0 {
		want[GrantServiceAccountLabel] = sa
	}
	if jti, ok := strings.CutPrefix(grant.Annotations[GrantCredentialIDAnnotation], "JTI="); ok && len(validation.IsValidLabelValue(jti)) == 0 {
		want[GrantJTILabel] = jti
	}
	return want
}

// gcFinalizers are the finalizers the API server sets on an object deleted
// in the foreground or orphaning its dependents, which the garbage
// collector removes.
var gcFinalizers = []string{metav1.FinalizerDeleteDependents, metav1.FinalizerOrphanDependents}

// foreignFinalizers reports whether grant holds a finalizer that neither
// the agent nor a delete set. A finalizer holds a deleted grant, and its
// token, alive: the spoke refuses a token only a minute after its bound
// Secret's deletion began.
func foreignFinalizers(grant *corev1.Secret) bool {
	for _, f := range grant.Finalizers {
		if grant.DeletionTimestamp == nil || !slices.Contains(gcFinalizers, f) {
			return true
		}
	}
	return false
}

// agentPrefix is the prefix of the agent's own labels and annotations.
// Keys under other prefixes are not the agent's: a mutating webhook or
// policy may stamp them on every Secret, and they steer no trust decision,
// so the agent ignores them.
const agentPrefix = "credbroker.io/"

// agentKeys returns the keys of m under agentPrefix, sorted.
func agentKeys(m map[string]string) []string {
	var out []string
	for k := range m {
		if strings.HasPrefix(k, agentPrefix) {
			out = append(out, k)
		}
	}
	slices.Sort(out)
	return out
}

// foreignChange returns what in grant the agent would not have written,
// or "" when nothing. Only the agent's own labels and annotations (under
// credbroker.io/) are judged, with finalizers, data, owners and
// immutability. Of a grant being deleted the data, owners and immutability
// are not judged: they cannot change once the grant was judged alive. An
// expiry that lies further past the grant's creation than the agent ever
// writes is a change too: maxLifetime, the longest token the agent mints,
// after the longest a pooled grant waits for its mint, and a clock skew.
func foreignChange(grant *corev1.Secret, maxLifetime time.Duration) string {
	if foreignFinalizers(grant) {
		return "finalizers added"
	}
	if grant.DeletionTimestamp == nil {
		switch {
		case len(grant.Data) > 0 || len(grant.StringData) > 0:
			return "data added"
		case len(grant.OwnerReferences) > 0:
			return "owner references added"
		case grant.Immutable != nil && *grant.Immutable:
			return "made immutable"
		}
	}
	want := wantLabels(grant)
	for _, k := range []string{GrantLabel, GrantServiceAccountLabel, GrantJTILabel} {
		got, ok := grant.Labels[k]
		w, wanted := want[k]
		switch {
		case wanted && !ok:
			return "label " + k + " removed"
		case ok && got != w:
			if !wanted {
				return "label " + k + " added"
			}
			return "label " + k + " changed"
		}
	}
	for _, k := range agentKeys(grant.Labels) {
		if _, ok := want[k]; !ok {
			return "label " + k + " added"
		}
	}
	required, allowed := grantAnnotations, claimedKeys
	if unclaimed(grant) {
		required, allowed = pooledAnnotations, pooledAnnotations
	}
	for _, k := range required {
		if _, ok := grant.Annotations[k]; !ok {
			return "annotation " + k + " removed"
		}
	}
	exp, err := time.Parse(time.RFC3339, grant.Annotations[GrantExpirationAnnotation])
	if err != nil || unclaimed(grant) && !grant.CreationTimestamp.IsZero() &&
		exp.After(grant.CreationTimestamp.Add(poolGrantTTL+poolClockSkew)) {
		// A pooled grant lives poolGrantTTL; a later expiry would keep a
		// token whose claim never landed from being collected.
		return "annotation " + GrantExpirationAnnotation + " changed"
	}
	if !grant.CreationTimestamp.IsZero() && exp.After(grant.CreationTimestamp.Add(poolGrantTTL+maxLifetime+poolClockSkew)) {
		// No token the agent mints outlives this; a later expiry is
		// someone else's, and the brokers would drop it (trust round 3).
		return "annotation " + GrantExpirationAnnotation + " changed"
	}
	for _, k := range agentKeys(grant.Annotations) {
		if !slices.Contains(allowed, k) {
			return "annotation " + k + " added"
		}
	}
	return ""
}

// changedFrom returns what changed from old to now that the agent would
// not have changed, or "" when nothing: the agent records a token's
// credential id and expiry once, and never changes an owner or scope
// annotation, also while the grant is being deleted; except that its own
// claim (ownClaim) of a pooled grant writes them all once, but the
// ServiceAccount.
func changedFrom(old, now *corev1.Secret, ownClaim bool) string {
	keys := slices.Clone(writtenOnce)
	if ownClaim && unclaimed(old) {
		keys = []string{GrantServiceAccountAnnotation}
	} else if old.Annotations[GrantCredentialIDAnnotation] != "" || now.Annotations[GrantCredentialIDAnnotation] == "" {
		// Not the mint recording the token: the credential id and the
		// expiry stay as they are.
		keys = append(keys, GrantCredentialIDAnnotation, GrantTokenSHA256Annotation, GrantExpirationAnnotation)
	}
	for _, k := range keys {
		was, had := old.Annotations[k]
		is, has := now.Annotations[k]
		switch {
		case had && !has:
			return "annotation " + k + " removed"
		case was != is:
			return "annotation " + k + " changed"
		}
	}
	return ""
}

// markChanged records that someone else changed grant, as rec says, and
// queues it for deletion; it does nothing if grant is marked already.
func (m *Minter) markChanged(grant *corev1.Secret, rec changedGrant) {
	if claimed := m.claims.get(grant.UID); claimed != nil && rec.credentialID == "" {
		// A pooled grant changed before its claim landed: the claim says
		// what the agent wrote.
		rec.credentialID, rec.cluster = claimed.Annotations[GrantCredentialIDAnnotation], claimed.Annotations[GrantClusterProfileAnnotation]
		rec.expires = m.expiration(claimed)
	}
	c := &m.changes
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.changed[grant.UID]; ok {
		return
	}
	if c.changed == nil {
		c.changed = map[types.UID]changedGrant{}
	}
	rec.namespace, rec.name = grant.Namespace, grant.Name
	c.changed[grant.UID] = rec
	m.log.Info("found a grant that someone other than the agent changed; deleting it",
		"grant", grant.Namespace+"/"+grant.Name,
		fleet.LogCredentialID, rec.credentialID,
		"clusterProfile", rec.cluster,
		"change", rec.change,
	)
	if c.queue != nil {
		c.queue.Add(grantRef{namespace: grant.Namespace, name: grant.Name, uid: grant.UID})
	}
}

// queueAllChanged queues every grant marked changed for deletion, and
// returns how many.
func (m *Minter) queueAllChanged() int {
	c := &m.changes
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.queue == nil {
		return 0
	}
	for uid, rec := range c.changed {
		c.queue.Add(grantRef{namespace: rec.namespace, name: rec.name, uid: uid})
	}
	return len(c.changed)
}

// setChangedQueue makes queue the queue of changed grants' deletes, or
// none when nil.
func (m *Minter) setChangedQueue(queue workqueue.TypedRateLimitingInterface[grantRef]) {
	m.changes.mu.Lock()
	defer m.changes.mu.Unlock()
	m.changes.queue = queue
}

// changedRecord returns what the agent keeps of the grant of UID uid, if
// someone else changed it.
func (m *Minter) changedRecord(uid types.UID) (changedGrant, bool) {
	m.changes.mu.Lock()
	defer m.changes.mu.Unlock()
	rec, ok := m.changes.changed[uid]
	return rec, ok
}

// forgetChanged drops what the agent keeps of the grant of UID uid, which
// is gone, and returns it.
func (m *Minter) forgetChanged(uid types.UID) (changedGrant, bool) {
	m.changes.mu.Lock()
	defer m.changes.mu.Unlock()
	rec, ok := m.changes.changed[uid]
	delete(m.changes.changed, uid)
	return rec, ok
}

// learnCredentialID records id as the credential id of the changed grant
// of UID uid, if the agent could not tell it before.
func (m *Minter) learnCredentialID(uid types.UID, id string) {
	m.changes.mu.Lock()
	defer m.changes.mu.Unlock()
	if rec, ok := m.changes.changed[uid]; ok && rec.credentialID == "" {
		rec.credentialID = id
		m.changes.changed[uid] = rec
	}
}

// recorded returns grant's credential id and ClusterProfile as the agent
// wrote them: for a grant someone else changed, what the agent had
// recorded before.
func (m *Minter) recorded(grant *corev1.Secret) (credentialID, cluster string) {
	if rec, ok := m.changedRecord(grant.UID); ok {
		return rec.credentialID, rec.cluster
	}
	return grant.Annotations[GrantCredentialIDAnnotation], grant.Annotations[GrantClusterProfileAnnotation]
}

// soleCredentialID returns grant's credential id if no other grant in
// GrantCache records it, or "": a grant first seen changed may carry
// another grant's credential id, whose removal the agent must not report.
func (m *Minter) soleCredentialID(grant *corev1.Secret) string {
	id := grant.Annotations[GrantCredentialIDAnnotation]
	if id == "" {
		return ""
	}
	objs, err := m.grantCache.ByIndex(GrantCredentialIDIndex, id)
	if err != nil {
		return ""
	}
	for _, obj := range objs {
		if g, ok := obj.(*corev1.Secret); ok && g.UID != grant.UID {
			return ""
		}
	}
	return id
}

// checkSeen judges a grant the agent sees for the first time, at start-up
// or when it is created: it returns true, and marks it, if someone else
// changed it.
func (m *Minter) checkSeen(grant *corev1.Secret) bool {
	if _, ok := m.changedRecord(grant.UID); ok {
		return true
	}
	why := foreignChange(grant, m.maxLifetime())
	if why == "" {
		return false
	}
	m.markChanged(grant, changedGrant{
		credentialID: m.soleCredentialID(grant),
		cluster:      grant.Annotations[GrantClusterProfileAnnotation],
		expires:      m.expiration(grant),
		change:       why,
	})
	return true
}

// checkUpdate judges the change of a grant from old to now: it returns
// true, and marks the grant, if someone else changed it, now or before.
func (m *Minter) checkUpdate(old, now *corev1.Secret) bool {
	if _, ok := m.changedRecord(now.UID); ok {
		if id := now.Annotations[GrantCredentialIDAnnotation]; id != "" {
			// The mint's own record of the credential id, after a change
			// by someone else: the agent reports its removal once gone.
			if m.soleCredentialID(now) == id && old.Annotations[GrantCredentialIDAnnotation] == "" {
				m.learnCredentialID(now.UID, id)
			}
		}
		return true
	}
	// A claim of a pooled grant that this agent did not create is judged
	// by its shape, as a grant first seen claimed is (checkSeen): another
	// replica of the agent claims the grants it pooled, and only the
	// grants this agent pooled have a claim it must have written.
	ownClaim := m.claims.ownClaim(now) || unclaimed(old) && !m.pooledHere(now.UID)
	why := changedFrom(old, now, ownClaim)
	if why == "" {
		why = foreignChange(now, m.maxLifetime())
	}
	if why == "" {
		return false
	}
	m.markChanged(now, changedGrant{
		credentialID: old.Annotations[GrantCredentialIDAnnotation],
		cluster:      old.Annotations[GrantClusterProfileAnnotation],
		expires:      m.expiration(old),
		change:       why,
	})
	return true
}

// deleteChanged deletes the grant ref, which someone else changed, if its
// UID is still the same, and logs it. A grant already gone is no error.
func (m *Minter) deleteChanged(ctx context.Context, ref grantRef) error {
	rec, ok := m.changedRecord(ref.uid)
	if !ok {
		return nil // deleted since
	}
	err := m.grants.Delete(ctx, ref.namespace, ref.name, ref.uid)
	switch {
	case gone(err):
		return nil
	case err != nil:
		return fmt.Errorf("delete grant %s/%s of credential %s, which someone other than the agent changed (%s): %w",
			ref.namespace, ref.name, rec.credentialID, rec.change, err)
	}
	if obj, ok, _ := m.grantCache.GetByKey(ref.namespace + "/" + ref.name); ok {
		if g, ok := obj.(*corev1.Secret); ok && g.UID == ref.uid && foreignFinalizers(g) {
			// Let the delete finish now. The UID makes the patch fail on
			// another object of that name.
			patch := fmt.Sprintf(`{"metadata":{"uid":%q,"finalizers":null}}`, ref.uid)
			if err := m.grants.Patch(ctx, ref.namespace, ref.name, []byte(patch)); err != nil && !gone(err) {
				return fmt.Errorf("remove the finalizers of grant %s/%s of credential %s, which someone other than the agent added: %w",
					ref.namespace, ref.name, rec.credentialID, err)
			}
		}
	}
	m.stopTimer(ref.uid)
	m.log.Info("deleted a grant that someone other than the agent changed",
		"grant", ref.namespace+"/"+ref.name,
		fleet.LogCredentialID, rec.credentialID,
		"clusterProfile", rec.cluster,
		"change", rec.change,
	)
	return nil
}
