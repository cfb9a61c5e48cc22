package grants

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// pendingRevoke is a revoke that has not reached an agent yet.
type pendingRevoke struct {
	grant  *pb.Grant
	reason string
	// learnt marks a revoke that Learn took from the recorded ones, and
	// drops once the record is gone.
	learnt bool
}

// retryQueue is the revokes of one ClusterProfile to send again, by
// credential id; quiet says that all were asked for quietly.
type retryQueue struct {
	revokes map[string]pendingRevoke
	quiet   bool
}

// foreignID reports whether id is a live or revoked grant of a
// ClusterProfile other than cluster: a revoke of id for cluster, such as a
// pending-revokes record that names another ClusterProfile's credential
// id, must neither drop it nor mark it revoked, since cluster's agents,
// which do not hold it, answer it gone. r.mu is held.
func (r *Registry) foreignID(id string, cluster types.NamespacedName) (heldElsewhere, bool) {
	if rec, ok := r.live[id]; ok && rec.cluster != cluster {
		return heldElsewhere{id: id, holder: rec.cluster, state: "live"}, true
	}
	if rec, ok := r.revoked[id]; ok && rec.cluster != cluster {
		return heldElsewhere{id: id, holder: rec.cluster, state: "revoked"}, true
	}
	return heldElsewhere{}, false
}

// logForeign logs, in one line, the revokes of ids that foreignID found
// held by another ClusterProfile, in what (for logs).
func (r *Registry) logForeign(what string, foreign []heldElsewhere) {
	if len(foreign) == 0 {
		return
	}
	r.cfg.Log.Info("revoke of another ClusterProfile's credential id ignored",
		"in", what, fleet.LogCredentialID, foreign[0].id, fleet.LogHolder, foreign[0].holder.String(), "state", foreign[0].state,
		fleet.LogIgnored, len(foreign))
}

// retry sends list again; quiet leaves out the log line of a revoke that
// found no agent connected.
func (r *Registry) retry(ctx context.Context, list []pendingRevoke, quiet bool) {
	byReason := map[string][]*pb.Grant{}
	learnt := map[string]bool{}
	for _, p := range list {
		byReason[p.reason] = append(byReason[p.reason], p.grant)
		if p.learnt {
			learnt[p.grant.GetCredentialId()] = true
		}
	}
	for reason, gs := range byReason {
		r.deliver(ctx, gs, reason, quiet, learnt)
	}
}

// sendAgain queues list, by ClusterProfile, for sendRetries to send again,
// and starts the sender of each ClusterProfile that has none running. What
// is queued while a send is in flight goes once after it, however often it
// was asked for: a stream that reports the same revoked ids in a loop sets
// off no more than one request at a time per ClusterProfile, and each id
// at most once per RetryInterval. quiet leaves out the log line of a
// revoke that found no agent connected.
func (r *Registry) sendAgain(ctx context.Context, list []pendingRevoke, quiet bool) {
	if len(list) == 0 {
		return
	}
	var start []types.NamespacedName
	r.mu.Lock()
	for _, p := range list {
		c := ClusterRef(p.grant).NamespacedName
		q := r.retries[c]
		if q == nil {
			q = &retryQueue{revokes: map[string]pendingRevoke{}, quiet: true}
			r.retries[c] = q
			start = append(start, c)
		}
		q.revokes[p.grant.GetCredentialId()] = p
		q.quiet = q.quiet && quiet
	}
	r.mu.Unlock()
	for _, c := range start {
		go r.sendRetries(context.WithoutCancel(ctx), c)
	}
}

// sendRetries sends the queued revokes of cluster, those whose id was sent
// within RetryInterval once it has passed, until none is queued, and then
// removes the queue, under the lock that sendAgain takes, so that no
// queued revoke is left without a sender.
func (r *Registry) sendRetries(ctx context.Context, cluster types.NamespacedName) {
	var waited time.Time // now is no earlier than the end of a wait
	for {
		r.mu.Lock()
		q := r.retries[cluster]
		if q == nil {
			r.mu.Unlock()
			return
		}
		now := r.cfg.Clock.Now()
		if now.Before(waited) {
			now = waited
		}
		var (
			due  []pendingRevoke
			wait time.Duration
		)
		for id, p := range q.revokes {
			if !p.grant.GetExpirationTime().AsTime().After(now) {
				delete(q.revokes, id)
				continue
			}
			if at, ok := r.sent[id]; ok && now.Sub(at) < r.cfg.RetryInterval && !now.Before(at) {
				if left := r.cfg.RetryInterval - now.Sub(at); wait == 0 || left < wait {
					wait = left
				}
				continue
			}
			delete(q.revokes, id)
			r.sent[id] = now
			due = append(due, p)
		}
		quiet := q.quiet
		if len(due) > 0 {
			q.quiet = true
		}
		if len(due) == 0 && len(q.revokes) == 0 {
			delete(r.retries, cluster)
			r.mu.Unlock()
			return
		}
		r.mu.Unlock()
		if len(due) == 0 {
			r.after(wait)
			waited = now.Add(wait)
			continue
		}
		slices.SortFunc(due, func(a, b pendingRevoke) int { return cmp.Compare(a.grant.GetCredentialId(), b.grant.GetCredentialId()) })
		r.retry(ctx, due, quiet)
	}
}

// after waits d, on Clock when it is a clock.Clock.
func (r *Registry) after(d time.Duration) {
	if c, ok := r.cfg.Clock.(clock.Clock); ok {
		<-c.After(d)
		return
	}
	<-time.After(d)
}

// deliver asks the agents to delete grants, one request per ClusterProfile
// incarnation, as RevokeRecorded says, and forgets the recorded revokes
// that an agent confirmed; it records none. quiet leaves out the log line
// of a revoke that found no agent connected.
//
// The ids of learnt are those of learnt revokes (see dropUnrecorded): one
// whose record is gone meanwhile is neither sent nor held again.
func (r *Registry) deliver(ctx context.Context, grants []*pb.Grant, reason string, quiet bool, learnt map[string]bool) (revoked, pending []*pb.Grant) {
	byCluster := map[fleet.ClusterRef][]*pb.Grant{}
	var (
		clusters []fleet.ClusterRef
		foreign  []heldElsewhere
	)
	r.mu.Lock()
	for _, g := range grants {
		c := ClusterRef(g)
		if h, ok := r.foreignID(g.GetCredentialId(), c.NamespacedName); ok {
			foreign = append(foreign, h)
			continue
		}
		cur, ok := r.pending[g.GetCredentialId()]
		if learnt[g.GetCredentialId()] && (!ok || !cur.learnt) {
			continue
		}
		// A learnt revoke stays learnt when it is sent again.
		r.pending[g.GetCredentialId()] = pendingRevoke{grant: g, reason: reason, learnt: cur.learnt}
		if _, ok := byCluster[c]; !ok {
			clusters = append(clusters, c)
		}
		byCluster[c] = append(byCluster[c], g)
	}
	r.mu.Unlock()
	r.logForeign("revoke", foreign)
	for _, cluster := range clusters {
		gs := byCluster[cluster]
		ids := make([]string, len(gs))
		for i, g := range gs {
			ids[i] = g.GetCredentialId()
		}
		gone, err := r.cfg.Revoker.Revoke(ctx, cluster, ids, reason)
		if err != nil && (!quiet || !errors.Is(err, errdefs.ErrUnavailable)) {
			r.cfg.Log.Info("revoke not delivered; it is sent again when the agent reports the grants",
				fleet.LogCluster, cluster.String(), fleet.LogGrants, len(ids), fleet.LogErr, err.Error())
		}
		if errors.Is(err, fleet.ErrNoAgent) {
			// Nothing was sent: the next agent to connect gets the
			// revoke at once, not a RetryInterval later.
			r.mu.Lock()
			for _, id := range ids {
				delete(r.sent, id)
			}
			r.mu.Unlock()
		}
		isGone := make(map[string]bool, len(gone))
		for _, id := range gone {
			isGone[id] = true
		}
		foreign = foreign[:0]
		r.mu.Lock()
		for _, g := range gs {
			id := g.GetCredentialId()
			if !isGone[id] {
				pending = append(pending, g)
				continue
			}
			delete(r.pending, id)
			if h, ok := r.foreignID(id, cluster.NamespacedName); ok {
				// Another ClusterProfile's agent reported it meanwhile:
				// this one's "gone" says nothing of that grant.
				foreign = append(foreign, h)
				continue
			}
			r.drop(id)
			r.markRevoked(id, cluster.NamespacedName, g.GetExpirationTime().AsTime(), reason, true)
			revoked = append(revoked, g)
		}
		r.mu.Unlock()
		r.logForeign("revoke answer", foreign)
		r.forget(gone)
	}
	return revoked, pending
}
