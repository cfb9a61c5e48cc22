package grants

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/protobuf/proto"
	"k8s.io/apimachinery/pkg/types"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// own returns a copy of g, of an agent of cluster, with the UID of cluster,
// and whether it belongs to cluster: the broker, not the agent, says which
// ClusterProfile a stream serves, so a grant recorded for another one is
// not taken. A grant recorded for another incarnation of cluster is stale:
// the ClusterProfile was replaced. It returns nil for a grant without a
// credential id or an expiry.
func own(cluster fleet.ClusterRef, g *pb.Grant) (_ *pb.Grant, stale bool) {
	if g.GetCredentialId() == "" || g.GetExpirationTime() == nil ||
		g.GetCluster().GetNamespace() != cluster.Namespace || g.GetCluster().GetName() != cluster.Name {
		return nil, false
	}
	g = proto.Clone(g).(*pb.Grant)
	if g.GetClusterUid() != "" && g.GetClusterUid() != string(cluster.UID) {
		return g, true
	}
	g.ClusterUid = string(cluster.UID)
	return g, false
}

// Hello applies the grants an agent of cluster reported in its hello, as
// Report applies those of a GrantUpdate.
func (r *Registry) Hello(ctx context.Context, cluster fleet.ClusterRef, grants []*pb.Grant) error {
	if err := r.report(ctx, cluster, "hello", &pb.GrantUpdate{Added: grants}); err != nil {
		return err
	}
	r.retryUnreported(ctx, cluster, grants)
	return nil
}

// Report applies a GrantUpdate of an agent of cluster. A grant that breaks
// a bound of RegistryConfig (larger than MaxGrantBytes, a credential id
// longer than MaxCredentialIDBytes, an expiry past MaxGrantLifetime) is
// dropped and logged, and the rest of the report applies: drop the item,
// not the stream, so that one grant that someone else wrote on the spoke
// costs its ClusterProfile nothing else. Report refuses, with an error
// wrapping errdefs.ErrResourceExhausted, a report whose grants would make
// its ClusterProfile's share pass MaxGrantsPerCluster or
// MaxGrantBytesPerCluster: it adds nothing, though its removals are
// applied, and it is logged; the tunnel then closes the agent's stream.
func (r *Registry) Report(ctx context.Context, cluster fleet.ClusterRef, u *pb.GrantUpdate) error {
	return r.report(ctx, cluster, "grant update", u)
}

// Update records the grants of u, of cluster, as Report does, and only
// logs a refusal: the exchange tells the registry of every token it
// mints, which it checked already.
func (r *Registry) Update(ctx context.Context, cluster fleet.ClusterRef, u *pb.GrantUpdate) {
	_ = r.report(ctx, cluster, "exchange", u)
}

// report applies u, of an agent of cluster, reported in frame (for logs).
// It sends again the pending revokes of the grants
// it adds. A hello adds and never removes: the agents of one ClusterProfile
// may see different grants (one scoped to a namespace, or an agent on
// another cluster that holds the profile's SVID), and none may hide
// another's grants from List and Revoke. A grant leaves when an agent
// reports its deletion, when a revoke finds it gone, or when its token
// expires. It revokes, at once, the grants
// it adds that were minted through another incarnation of cluster: the
// ClusterProfile was deleted and created again since, and they are not the
// new one's.
func (r *Registry) report(ctx context.Context, cluster fleet.ClusterRef, frame string, u *pb.GrantUpdate) error {
	now := r.cfg.Clock.Now()
	adds, stale := r.readAdded(cluster, frame, u.GetAdded(), now)
	r.mu.Lock()
	r.expire(now)
	retry := r.removeReported(cluster.NamespacedName, u.GetRemoved())
	a := r.admit(cluster.NamespacedName, adds)
	retry = append(retry, a.retry...)
	err := r.checkShare(cluster, frame, a.use)
	if err == nil {
		for _, rec := range a.take {
			r.drop(rec.id)
			r.put(rec)
		}
	}
	r.mu.Unlock()
	if len(a.taken) > 0 {
		// One line per report, so that an agent cannot fill the log.
		r.cfg.Log.Info("agent reported the credential id of another ClusterProfile's grant; ignored it",
			fleet.LogCluster, cluster.String(), fleet.LogHolder, a.taken[0].holder.String(), fleet.LogCredentialID, a.taken[0].id,
			"state", a.taken[0].state, "frame", frame, fleet.LogIgnored, len(a.taken))
	}
	r.sendAgain(ctx, retry, false)
	if len(stale) > 0 {
		go r.revokeStale(context.WithoutCancel(ctx), cluster, stale)
	}
	return err
}

// readAdded reads what each grant of added, of an agent of cluster,
// reported in frame, is, off the lock: the records of the live ones of
// cluster, the last report of an id winning, and the ids of those minted
// through another incarnation of cluster (stale). A grant that breaks a
// bound of RegistryConfig is dropped; one line logs the first and how
// many, so that an agent cannot fill the log.
func (r *Registry) readAdded(cluster fleet.ClusterRef, frame string, added []*pb.Grant, now time.Time) (adds []*record, stale []string) {
	at := map[string]int{} // the last report of an id wins
	var (
		dropped             int
		firstID, firstBound string
		firstErr            error
	)
	for _, g := range added {
		size := proto.Size(g)
		if bound, err := r.checkGrant(g, size, now); err != nil {
			if dropped == 0 {
				firstID, firstBound, firstErr = clip(g.GetCredentialId(), MaxCredentialIDBytes), bound, err
			}
			dropped++
			continue
		}
		g, old := own(cluster, g)
		if g == nil || !g.GetExpirationTime().AsTime().After(now) {
			continue
		}
		if old {
			stale = append(stale, g.GetCredentialId())
			continue
		}
		rec := &record{id: g.GetCredentialId(), grant: g, cluster: cluster.NamespacedName,
			expires: g.GetExpirationTime().AsTime(), size: size + grantOverhead}
		if i, ok := at[rec.id]; ok {
			adds[i] = rec
			continue
		}
		at[rec.id] = len(adds)
		adds = append(adds, rec)
	}
	if dropped > 0 {
		r.cfg.Log.Info("agent reported grants past a bound; dropped them and kept the rest of the report",
			fleet.LogCluster, cluster.String(), "frame", frame, "bound", firstBound, fleet.LogCredentialID, firstID,
			fleet.LogReason, firstErr.Error(), "dropped", dropped)
	}
	return adds, stale
}

// clip returns s cut to at most n bytes, marked when cut.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// checkGrant returns the bound, and why, when g, of size bytes, is larger
// than MaxGrantBytes, its credential id longer than MaxCredentialIDBytes
// or its expiry past MaxGrantLifetime.
func (r *Registry) checkGrant(g *pb.Grant, size int, now time.Time) (bound string, _ error) {
	latest := now.Add(r.cfg.MaxGrantLifetime + fleet.MaxClockSkew)
	switch {
	case size > r.cfg.MaxGrantBytes:
		return "grantBytes", fmt.Errorf("a grant of %d bytes, more than the %d bytes a grant may have", size, r.cfg.MaxGrantBytes)
	case len(g.GetCredentialId()) > MaxCredentialIDBytes:
		return "credentialIDBytes", fmt.Errorf("a credential id of %d bytes, more than %d", len(g.GetCredentialId()), MaxCredentialIDBytes)
	case g.GetExpirationTime() != nil && g.GetExpirationTime().AsTime().After(latest):
		return "grantLifetime", fmt.Errorf("a grant that expires at %s, later than %s, the broker's maximum token lifetime (%s) and %s of clock skew from now",
			g.GetExpirationTime().AsTime().UTC().Format(time.RFC3339), latest.UTC().Format(time.RFC3339), r.cfg.MaxGrantLifetime, fleet.MaxClockSkew)
	}
	return "", nil
}

// removeReported applies the removals of ids that an agent of cluster
// reported, and returns the pending revokes among them, to send again.
// r.mu is held.
func (r *Registry) removeReported(cluster types.NamespacedName, ids []string) (retry []pendingRevoke) {
	for _, id := range ids {
		if rec, ok := r.live[id]; ok && rec.cluster == cluster {
			r.drop(id)
			r.markRevoked(id, rec.cluster, rec.expires, ReasonReportedDeleted, false)
		}
		if p, ok := r.pending[id]; ok && ClusterRef(p.grant).NamespacedName == cluster {
			// A removal is one stream's word, and every stream of the
			// cluster is sent the pending ids: the revoke stays pending,
			// and recorded, until every agent instance confirms it.
			retry = append(retry, p)
		}
	}
	return retry
}

// admission is what report makes of the grants an agent of a
// ClusterProfile reported live.
type admission struct {
	take  []*record       // the grants to hold
	use   usage           // the ClusterProfile's usage once they are held
	retry []pendingRevoke // the revokes to send again
	taken []heldElsewhere // the ids of other ClusterProfiles' grants, ignored
}

// admit sorts adds, reported by an agent of cluster: those of other
// ClusterProfiles are ignored, those revoked or pending a revoke have it
// sent again, and the rest are taken. r.mu is held.
func (r *Registry) admit(cluster types.NamespacedName, adds []*record) admission {
	var a admission
	if u := r.use[cluster]; u != nil {
		a.use = *u
	}
	for _, rec := range adds {
		id := rec.id
		if h, ok := r.heldElsewhere(id, cluster); ok {
			a.taken = append(a.taken, h)
			continue
		}
		if gone, ok := r.revoked[id]; ok {
			// Reported by an agent that has not seen the delete yet, or by
			// one that never got the revoke: those that answered it
			// "gone" (agents that did not hold the grant, or a rogue
			// holder of the cluster's SVID) may have been all that were
			// connected. The revoke goes again; an agent that no longer
			// holds the grant confirms it.
			p, ok := r.pending[id]
			if !ok {
				p = pendingRevoke{grant: rec.grant, reason: gone.reason}
			}
			a.retry = append(a.retry, p)
			continue
		}
		if p, ok := r.pending[id]; ok {
			a.retry = append(a.retry, p)
		}
		if old, ok := r.live[id]; ok {
			a.use.bytes += rec.size - old.size
		} else {
			a.use.grants++
			a.use.bytes += rec.size
		}
		a.take = append(a.take, rec)
	}
	return a
}

// checkShare refuses a report of an agent of cluster, in frame, whose
// grants would make the ClusterProfile's usage pass MaxGrantsPerCluster or
// MaxGrantBytesPerCluster.
func (r *Registry) checkShare(cluster fleet.ClusterRef, frame string, use usage) error {
	switch {
	case use.grants > r.cfg.MaxGrantsPerCluster:
		return r.refuse(cluster, frame, "clusterGrants", use.grants, r.cfg.MaxGrantsPerCluster,
			fmt.Errorf("%d live grants for ClusterProfile %s, more than the %d it may have: %w",
				use.grants, cluster, r.cfg.MaxGrantsPerCluster, errdefs.ErrResourceExhausted))
	case use.bytes > r.cfg.MaxGrantBytesPerCluster:
		return r.refuse(cluster, frame, "clusterBytes", use.bytes, r.cfg.MaxGrantBytesPerCluster,
			fmt.Errorf("%d bytes of grants for ClusterProfile %s, more than the %d it may have: %w",
				use.bytes, cluster, r.cfg.MaxGrantBytesPerCluster, errdefs.ErrResourceExhausted))
	}
	return nil
}

// heldElsewhere is a credential id that an agent reported for its own
// ClusterProfile while the registry knows it as a grant of holder: live,
// pending revoke, or revoked.
type heldElsewhere struct {
	id     string
	holder types.NamespacedName
	state  string
}

// heldElsewhere reports whether id is a live, pending or revoked grant of a
// ClusterProfile other than cluster. A credential id names one grant, of
// one ClusterProfile: an agent of another that reports it (a compromised
// one, or an honest one that reports a forged grant Secret) would
// otherwise take the grant over, and its revokes would go to that agent,
// which answers "gone" while the real grant and its token live on. r.mu is
// held.
func (r *Registry) heldElsewhere(id string, cluster types.NamespacedName) (heldElsewhere, bool) {
	if rec, ok := r.live[id]; ok && rec.cluster != cluster {
		return heldElsewhere{id: id, holder: rec.cluster, state: "live"}, true
	}
	if p, ok := r.pending[id]; ok {
		if holder := ClusterRef(p.grant).NamespacedName; holder != cluster {
			return heldElsewhere{id: id, holder: holder, state: "pending"}, true
		}
	}
	if rec, ok := r.revoked[id]; ok && rec.cluster != cluster {
		return heldElsewhere{id: id, holder: rec.cluster, state: "revoked"}, true
	}
	return heldElsewhere{}, false
}

// refuse logs a report of an agent of cluster, in frame, that breaks bound
// (size against max), and returns err, which says so to the agent.
func (r *Registry) refuse(cluster fleet.ClusterRef, frame, bound string, size, max int, err error) error {
	r.cfg.Log.Info("agent grant report refused; closing the stream",
		fleet.LogCluster, cluster.String(), "frame", frame, "bound", bound, "size", size, "max", max)
	return fmt.Errorf("the %s holds %w", frame, err)
}

// revokeStale revokes the grants of ids, of an earlier incarnation of
// cluster, through the agent of cluster that reported them. If that fails,
// the agent's next hello reports them again.
func (r *Registry) revokeStale(ctx context.Context, cluster fleet.ClusterRef, ids []string) {
	if _, err := r.cfg.Revoker.Revoke(ctx, cluster, ids, ReasonClusterProfileReplaced); err != nil {
		r.cfg.Log.Info("revoke of a replaced ClusterProfile's grants not delivered; it is sent again at the agent's next hello",
			fleet.LogCluster, cluster.String(), fleet.LogGrants, len(ids), fleet.LogErr, err.Error())
	}
}

// ReasonReportedDeleted is the reason of a revoke sent again for a grant
// that an agent reported deleted, and an agent then reported live.
const ReasonReportedDeleted = "an agent reported the grant deleted"

// ReasonClusterProfileReplaced is the reason of the revokes of grants minted
// through an earlier incarnation of a ClusterProfile.
const ReasonClusterProfileReplaced = "the ClusterProfile was deleted and created again"
