package grants

import (
	"container/heap"
	"time"

	"k8s.io/apimachinery/pkg/types"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// record is what the registry holds of one grant: a live one (grant is
// set) or a revoked one, whose token has not expired yet.
type record struct {
	id      string
	grant   *pb.Grant // never changed once stored: readers share it
	cluster types.NamespacedName
	expires time.Time
	// size is what the record counts against its cluster's
	// MaxGrantBytesPerCluster.
	size int
	// reason, of a revoked grant, is why it was revoked: the revoke is
	// sent again with it when an agent reports the grant live again.
	reason string
	// confirmed, of a revoked grant, says that every agent instance
	// answered its revoke, rather than one stream reporting it deleted.
	confirmed bool
	// index is the record's place in its expiryQueue.
	index int
}

// usage is what the registry holds for one ClusterProfile.
type usage struct {
	grants int // live grants
	bytes  int // live grants and revoked records, as record.size counts them
}

// put adds rec, a live grant whose id is not live, to the live grants.
// r.mu is held.
func (r *Registry) put(rec *record) {
	r.live[rec.id] = rec
	index(r.byCluster, rec.cluster, rec)
	index(r.byUser, rec.grant.GetSubject().GetUsername(), rec)
	u := r.use[rec.cluster]
	if u == nil {
		u = &usage{}
		r.use[rec.cluster] = u
	}
	u.grants++
	u.bytes += rec.size
	heap.Push(&r.liveQueue, rec)
}

// drop removes the live grant of id, if any. r.mu is held.
func (r *Registry) drop(id string) {
	rec, ok := r.live[id]
	if !ok {
		return
	}
	delete(r.live, id)
	unindex(r.byCluster, rec.cluster, id)
	unindex(r.byUser, rec.grant.GetSubject().GetUsername(), id)
	r.release(rec.cluster, 1, rec.size)
	heap.Remove(&r.liveQueue, rec.index)
}

// markRevoked records that the token of id, of cluster, which expires
// at expires, is revoked, for reason. r.mu is held.
func (r *Registry) markRevoked(id string, cluster types.NamespacedName, expires time.Time, reason string, confirmed bool) {
	if rec, ok := r.revoked[id]; ok {
		rec.confirmed = rec.confirmed || confirmed
		if expires.After(rec.expires) {
			rec.expires = expires
			heap.Fix(&r.revokedQueue, rec.index)
		}
		return
	}
	rec := &record{id: id, cluster: cluster, expires: expires, size: len(id) + revokedOverhead, reason: reason, confirmed: confirmed}
	r.revoked[id] = rec
	u := r.use[cluster]
	if u == nil {
		u = &usage{}
		r.use[cluster] = u
	}
	u.bytes += rec.size
	heap.Push(&r.revokedQueue, rec)
}

// release takes grants and bytes off the usage of cluster. r.mu is held.
func (r *Registry) release(cluster types.NamespacedName, grants, bytes int) {
	u := r.use[cluster]
	if u == nil {
		return
	}
	u.grants -= grants
	u.bytes -= bytes
	if u.grants <= 0 && u.bytes <= 0 {
		delete(r.use, cluster)
	}
}

func index[K comparable](m map[K]map[string]*record, k K, rec *record) {
	ids := m[k]
	if ids == nil {
		ids = map[string]*record{}
		m[k] = ids
	}
	ids[rec.id] = rec
}

func unindex[K comparable](m map[K]map[string]*record, k K, id string) {
	if ids := m[k]; ids != nil {
		delete(ids, id)
		if len(ids) == 0 {
			delete(m, k)
		}
	}
}

// expireEvery bounds how often expire scans the pending revokes.
const expireEvery = time.Second

// expire drops what is known of tokens that have expired by now: the
// records at the head of the expiry queues, and, at most once per
// expireEvery, the pending revokes. Readers skip expired grants
// themselves. r.mu is held.
func (r *Registry) expire(now time.Time) {
	for len(r.liveQueue) > 0 && !r.liveQueue[0].expires.After(now) {
		r.drop(r.liveQueue[0].id)
	}
	for len(r.revokedQueue) > 0 && !r.revokedQueue[0].expires.After(now) {
		rec := heap.Pop(&r.revokedQueue).(*record)
		delete(r.revoked, rec.id)
		r.release(rec.cluster, 0, rec.size)
	}
	if now.Sub(r.lastExpire) < expireEvery && !now.Before(r.lastExpire) {
		return
	}
	r.lastExpire = now
	for id, p := range r.pending {
		if !p.grant.GetExpirationTime().AsTime().After(now) {
			delete(r.pending, id)
		}
	}
	for id, at := range r.sent {
		if now.Sub(at) >= r.cfg.RetryInterval || now.Before(at) {
			delete(r.sent, id)
		}
	}
}

// expiryQueue is a heap of records, the earliest expiry first.
type expiryQueue []*record

func (q expiryQueue) Len() int           { return len(q) }
func (q expiryQueue) Less(i, j int) bool { return q[i].expires.Before(q[j].expires) }
func (q expiryQueue) Swap(i, j int) {
	q[i], q[j] = q[j], q[i]
	q[i].index, q[j].index = i, j
}
func (q *expiryQueue) Push(x any) {
	rec := x.(*record)
	rec.index = len(*q)
	*q = append(*q, rec)
}
func (q *expiryQueue) Pop() any {
	old := *q
	rec := old[len(old)-1]
	old[len(old)-1] = nil
	*q = old[:len(old)-1]
	return rec
}
