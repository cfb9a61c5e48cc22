package grants

import (
	"context"
	"fmt"

	"github.com/credbroker/credbroker/pkg/fleet"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// RevokeRecorded asks the agents to delete grants, one request per
// ClusterProfile incarnation, and returns the grants that an agent
// confirmed gone, and the pending ones, which no agent confirmed. With a
// RegistryConfig.Pending, the pending revokes are recorded there before it
// returns, so that every broker replica sends them again when an agent of
// their ClusterProfile connects or reports them, until an agent confirms
// or their tokens expire. When they could not be recorded, only this
// replica retries them, and the error, which wraps errdefs.ErrUnavailable
// or errdefs.ErrResourceExhausted, says so. Both lists keep the order of
// grants within each ClusterProfile, and the ClusterProfiles in the order
// they first appear. From the call on, Revoked reports every one of grants
// as revoked.
func (r *Registry) RevokeRecorded(ctx context.Context, grants []*pb.Grant, reason string) (revoked, pending []*pb.Grant, err error) {
	revoked, pending = r.deliver(ctx, grants, reason, false, nil)
	if len(pending) == 0 || r.cfg.Pending == nil {
		return revoked, pending, nil
	}
	records := make([]PendingRevoke, len(pending))
	for i, g := range pending {
		records[i] = PendingRevoke{Grant: &pb.Grant{
			CredentialId: g.GetCredentialId(), Cluster: g.GetCluster(),
			ClusterUid: g.GetClusterUid(), ExpirationTime: g.GetExpirationTime(),
		}, Reason: reason}
	}
	if err := r.cfg.Pending.Record(ctx, records); err != nil {
		return revoked, pending, fmt.Errorf("%d of %d grants were revoked; no agent confirmed the other %d, and their revokes were not recorded "+
			"for every broker replica to send again, so revoke them again: %w", len(revoked), len(grants), len(pending), err)
	}
	// An agent that came back meanwhile confirmed some.
	var done []string
	r.mu.Lock()
	for _, g := range pending {
		if _, ok := r.pending[g.GetCredentialId()]; !ok {
			done = append(done, g.GetCredentialId())
		}
	}
	r.mu.Unlock()
	r.forget(done)
	return revoked, pending, nil
}

// Revoke is RevokeRecorded for callers that need no more than a log line
// when the pending revokes could not be recorded, such as the triggers,
// which check the grants again later anyway.
func (r *Registry) Revoke(ctx context.Context, grants []*pb.Grant, reason string) (revoked, pending []*pb.Grant) {
	revoked, pending, err := r.RevokeRecorded(ctx, grants, reason)
	if err != nil {
		r.cfg.Log.Info("pending revokes not recorded; only this replica sends them again", fleet.LogGrants, len(pending), fleet.LogErr, err.Error())
	}
	return revoked, pending
}

// Learn takes the pending revokes that the replicas recorded (the broker
// passes those of its PendingStore, each time they change), and sends those
// it did not know of to their agents, if connected to this replica. Those
// whose revoke every agent instance confirmed to this replica are
// forgotten; one stream's report of a deletion confirms nothing.
func (r *Registry) Learn(ctx context.Context, revokes []PendingRevoke) {
	now := r.cfg.Clock.Now()
	var (
		fresh   []pendingRevoke
		done    []string
		foreign []heldElsewhere
	)
	r.mu.Lock()
	for _, p := range revokes {
		id := p.Grant.GetCredentialId()
		if id == "" || !p.Grant.GetExpirationTime().AsTime().After(now) {
			continue
		}
		if _, ok := r.pending[id]; ok {
			continue
		}
		if h, ok := r.foreignID(id, ClusterRef(p.Grant).NamespacedName); ok {
			// A record that names another ClusterProfile's grant (a
			// hand-edited one): its agents would answer it gone, and
			// the other's grant must not be taken for revoked.
			foreign = append(foreign, h)
			continue
		}
		if rec, ok := r.revoked[id]; ok && rec.confirmed {
			done = append(done, id)
			continue
		}
		r.pending[id] = pendingRevoke{grant: p.Grant, reason: p.Reason, learnt: true}
		fresh = append(fresh, r.pending[id])
	}
	r.dropUnrecorded(revokes)
	r.mu.Unlock()
	r.logForeign("recorded pending revokes", foreign)
	r.forget(done)
	r.sendAgain(ctx, fresh, true)
}

// retryUnreported sends again the pending revokes of cluster whose grants
// the agent's hello did not report (Update sends those of the grants it
// did): an agent answers the revoke of a grant it does not hold as gone,
// which confirms it.
func (r *Registry) retryUnreported(ctx context.Context, cluster fleet.ClusterRef, reported []*pb.Grant) {
	seen := make(map[string]bool, len(reported))
	for _, g := range reported {
		seen[g.GetCredentialId()] = true
	}
	var list []pendingRevoke
	r.mu.Lock()
	for id, p := range r.pending {
		if !seen[id] && ClusterRef(p.grant) == cluster {
			list = append(list, p)
		}
	}
	r.mu.Unlock()
	r.sendAgain(ctx, list, false)
}

// forget drops ids from the recorded pending revokes, if any.
func (r *Registry) forget(ids []string) {
	if len(ids) > 0 && r.cfg.Pending != nil {
		r.cfg.Pending.Forget(ids)
	}
}

// dropUnrecorded drops the learnt pending revokes that revokes, the
// records as they are now, no longer hold: another replica's agent
// confirmed them, or they expired or were removed. So rewriting the records
// again and again holds no more of them in memory than the record holds.
// A learnt revoke of a grant that this replica holds live is kept until
// its agent answers, so that no token of it is handed out again. r.mu is
// held.
func (r *Registry) dropUnrecorded(revokes []PendingRevoke) {
	recorded := make(map[string]bool, len(revokes))
	for _, p := range revokes {
		recorded[p.Grant.GetCredentialId()] = true
	}
	for id, p := range r.pending {
		if _, live := r.live[id]; p.learnt && !recorded[id] && !live {
			delete(r.pending, id)
		}
	}
}
