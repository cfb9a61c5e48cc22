package grants

import (
	"cmp"
	"container/heap"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/protobuf/proto"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/grants/selector"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// Revoker asks the agent of cluster to delete the grants of ids, and returns
// the ids whose grants are gone: deleted now, or before. Errors wrap
// errdefs sentinels; ErrUnavailable when no agent of cluster is connected.
// The broker passes the tunnel server.
type Revoker interface {
	Revoke(ctx context.Context, cluster fleet.ClusterRef, ids []string, reason string) ([]string, error)
}

// Selector picks grants; every field that is set must match, and the zero
// Selector matches every grant.
type Selector struct {
	CredentialID string
	Username     string
	Cluster      types.NamespacedName
	// ClusterUID, when set, matches one incarnation of Cluster.
	ClusterUID types.UID
}

// SelectorOf converts the wire form.
func SelectorOf(s *pb.GrantSelector) Selector {
	return Selector{
		CredentialID: s.GetCredentialId(),
		Username:     s.GetUsername(),
		Cluster:      types.NamespacedName{Namespace: s.GetCluster().GetNamespace(), Name: s.GetCluster().GetName()},
	}
}

// IsZero reports whether s matches every grant.
func (s Selector) IsZero() bool { return s == Selector{} }

func (s Selector) matches(g *pb.Grant) bool {
	return (s.CredentialID == "" || g.GetCredentialId() == s.CredentialID) &&
		(s.Username == "" || g.GetSubject().GetUsername() == s.Username) &&
		(s.Cluster.Namespace == "" || g.GetCluster().GetNamespace() == s.Cluster.Namespace) &&
		(s.Cluster.Name == "" || g.GetCluster().GetName() == s.Cluster.Name) &&
		(s.ClusterUID == "" || g.GetClusterUid() == string(s.ClusterUID))
}

// ClusterRef returns the ClusterProfile incarnation g was minted through.
func ClusterRef(g *pb.Grant) fleet.ClusterRef {
	return fleet.ClusterRef{
		NamespacedName: types.NamespacedName{Namespace: g.GetCluster().GetNamespace(), Name: g.GetCluster().GetName()},
		UID:            types.UID(g.GetClusterUid()),
	}
}

// RegistryConfig configures a Registry.
type RegistryConfig struct {
	// Revoker reaches the agents; required.
	Revoker Revoker
	// Clock drops grants, and what is known of revoked ones, once their
	// tokens expire. Default: the real clock.
	Clock clock.PassiveClock
	// Pending, when set, records the revokes that no agent confirmed, for
	// every broker replica to send again (a *PendingStore). Nil: they live
	// in this replica's memory only.
	Pending PendingRecorder
	// The bounds of what the agents of one ClusterProfile may make the
	// registry hold, so that a compromised agent cannot grow the broker's
	// memory: a report that breaks one is refused, and the tunnel closes
	// the agent's stream.
	//
	// MaxGrantsPerCluster bounds the live grants of one ClusterProfile.
	// Default DefaultMaxGrantsPerCluster.
	MaxGrantsPerCluster int
	// MaxGrantBytes bounds one grant, by its protobuf size. Default
	// DefaultMaxGrantBytes.
	MaxGrantBytes int
	// MaxGrantBytesPerCluster bounds what the registry holds for one
	// ClusterProfile: its live grants, each counted as its protobuf size
	// and grantOverhead, and a record of each grant its agents reported
	// deleted, until the grant's token expires. Default
	// DefaultMaxGrantBytesPerCluster.
	MaxGrantBytesPerCluster int
	// MaxGrantLifetime bounds the expiry of a reported grant to now plus
	// MaxGrantLifetime and fleet.MaxClockSkew: no token the broker
	// mints lives longer. The broker passes its MaxExpiration. Default
	// DefaultMaxGrantLifetime.
	MaxGrantLifetime time.Duration
	// RetryInterval is the least time between two sends of one grant's
	// revoke that agents' reports and hellos set off: a stream that
	// reports revoked or pending grants again and again, or reconnects in a
	// loop, makes the broker send each revoke once per RetryInterval at
	// most, and the revokes of one ClusterProfile are sent one request at
	// a time. A send that the interval holds back goes once it has passed,
	// timed by Clock when Clock is a clock.Clock. Default
	// DefaultRetryInterval.
	RetryInterval time.Duration
	// Log receives revocations that failed and refused reports. Default:
	// discard.
	Log logr.Logger
}

// The defaults of RegistryConfig's bounds.
const (
	// DefaultMaxGrantsPerCluster: far more tokens than one cluster's
	// consumers hold at once.
	DefaultMaxGrantsPerCluster = 100000
	// DefaultMaxGrantBytes is the largest grant an agent reports: the
	// agent's Client leaves out a grant that does not fit alone in its
	// 32 KiB frames.
	DefaultMaxGrantBytes = 32 << 10
	// DefaultMaxGrantBytesPerCluster holds some 50,000 grants of a typical
	// size (about 400 bytes and grantOverhead each).
	DefaultMaxGrantBytesPerCluster = 32 << 20
	// DefaultMaxGrantLifetime is the broker's default maximum expiration.
	DefaultMaxGrantLifetime = time.Hour
	// DefaultRetryInterval is the tunnel's default mint timeout: the
	// longest a revoke waits for one agent stream's answer.
	DefaultRetryInterval = 10 * time.Second
)

// MaxCredentialIDBytes bounds a reported grant's credential id: "JTI="
// and a JTI of at most 128 bytes, as a selector may name it.
const MaxCredentialIDBytes = len("JTI=") + selector.MaxJTILength

// What the registry counts against MaxGrantBytesPerCluster besides a
// grant's protobuf size: its record and index entries (grantOverhead), and
// for a revoked grant, its credential id and revokedOverhead.
const (
	grantOverhead   = 256
	revokedOverhead = 128
)

// pendingRevoke is a revoke that has not reached an agent yet.
type pendingRevoke struct {
	grant  *pb.Grant
	reason string
	// learnt marks a revoke that Learn took from the recorded ones, and
	// drops once the record is gone.
	learnt bool
}

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

// Registry holds the live grants of the fleet as the agents report them,
// and revokes them. It is safe for concurrent use. Every lookup is indexed
// (by credential id, ClusterProfile and username), so that a reader copies
// only what it returns, and expiry takes the expired records off a queue;
// the lock that Revoked, on every exchange, takes is held only for that.
type Registry struct {
	cfg RegistryConfig

	mu sync.RWMutex
	// live holds the live grants by credential id, also indexed by
	// ClusterProfile and by username; use counts them by ClusterProfile.
	live      map[string]*record
	byCluster map[types.NamespacedName]map[string]*record
	byUser    map[string]map[string]*record
	use       map[types.NamespacedName]*usage
	// lastExpire is when expire last scanned pending.
	lastExpire time.Time
	// revoked holds the grants revoked through this replica or reported
	// deleted by an agent, by credential id, until their tokens expire.
	revoked map[string]*record
	// liveQueue and revokedQueue order live and revoked by expiry.
	liveQueue, revokedQueue expiryQueue
	// pending holds the revokes that have not reached an agent, by
	// credential id.
	pending map[string]pendingRevoke
	// retries holds, by ClusterProfile, the revokes that reports, hellos
	// and Learn asked to send again; a ClusterProfile has an entry while
	// its one sender (sendRetries) runs.
	retries map[types.NamespacedName]*retryQueue
	// sent is when sendRetries last sent the revoke of a credential id,
	// for RetryInterval.
	sent map[string]time.Time
}

// retryQueue is the revokes of one ClusterProfile to send again, by
// credential id; quiet says that all were asked for quietly.
type retryQueue struct {
	revokes map[string]pendingRevoke
	quiet   bool
}

// NewRegistry returns an empty Registry.
func NewRegistry(cfg RegistryConfig) (*Registry, error) {
	if cfg.Revoker == nil {
		return nil, fmt.Errorf("grants: Revoker is required")
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	if cfg.MaxGrantsPerCluster <= 0 {
		cfg.MaxGrantsPerCluster = DefaultMaxGrantsPerCluster
	}
	if cfg.MaxGrantBytes <= 0 {
		cfg.MaxGrantBytes = DefaultMaxGrantBytes
	}
	if cfg.MaxGrantBytesPerCluster <= 0 {
		cfg.MaxGrantBytesPerCluster = DefaultMaxGrantBytesPerCluster
	}
	if cfg.MaxGrantLifetime <= 0 {
		cfg.MaxGrantLifetime = DefaultMaxGrantLifetime
	}
	if cfg.RetryInterval <= 0 {
		cfg.RetryInterval = DefaultRetryInterval
	}
	return &Registry{
		cfg:       cfg,
		live:      map[string]*record{},
		byCluster: map[types.NamespacedName]map[string]*record{},
		byUser:    map[string]map[string]*record{},
		use:       map[types.NamespacedName]*usage{},
		revoked:   map[string]*record{},
		pending:   map[string]pendingRevoke{},
		retries:   map[types.NamespacedName]*retryQueue{},
		sent:      map[string]time.Time{},
	}, nil
}

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

// Report applies a GrantUpdate of an agent of cluster. It refuses, with an
// error, a report that breaks a bound of RegistryConfig: one that holds a
// grant larger than MaxGrantBytes, a credential id longer than
// MaxCredentialIDBytes or an expiry past MaxGrantLifetime (wrapping
// errdefs.ErrInvalidArgument: no honest agent sends it), and one whose
// grants would make its ClusterProfile's share pass MaxGrantsPerCluster or
// MaxGrantBytesPerCluster (wrapping errdefs.ErrResourceExhausted). A
// refused report adds nothing, though the removals of one that breaks only
// the ClusterProfile's share are applied, and it is logged; the tunnel
// then closes the agent's stream.
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
	// What each grant is, off the lock.
	var (
		adds  []*record
		stale []string
		at    = map[string]int{} // the last report of an id wins
	)
	latest := now.Add(r.cfg.MaxGrantLifetime + fleet.MaxClockSkew)
	for _, g := range u.GetAdded() {
		size := proto.Size(g)
		switch {
		case size > r.cfg.MaxGrantBytes:
			return r.refuse(cluster, frame, "grantBytes", size, r.cfg.MaxGrantBytes,
				fmt.Errorf("a grant of %d bytes, more than the %d bytes a grant may have: %w", size, r.cfg.MaxGrantBytes, errdefs.ErrInvalidArgument))
		case len(g.GetCredentialId()) > MaxCredentialIDBytes:
			return r.refuse(cluster, frame, "credentialIDBytes", len(g.GetCredentialId()), MaxCredentialIDBytes,
				fmt.Errorf("a credential id of %d bytes, more than %d: %w", len(g.GetCredentialId()), MaxCredentialIDBytes, errdefs.ErrInvalidArgument))
		case g.GetExpirationTime() != nil && g.GetExpirationTime().AsTime().After(latest):
			return r.refuse(cluster, frame, "grantLifetime", int(g.GetExpirationTime().AsTime().Sub(now)/time.Second), int(latest.Sub(now)/time.Second),
				fmt.Errorf("a grant that expires at %s, later than %s, the broker's maximum token lifetime (%s) and %s of clock skew from now: %w",
					g.GetExpirationTime().AsTime().UTC().Format(time.RFC3339), latest.UTC().Format(time.RFC3339), r.cfg.MaxGrantLifetime,
					fleet.MaxClockSkew, errdefs.ErrInvalidArgument))
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

	var retry []pendingRevoke
	r.mu.Lock()
	r.expire(now)
	for _, id := range u.GetRemoved() {
		if rec, ok := r.live[id]; ok && rec.cluster == cluster.NamespacedName {
			r.drop(id)
			r.markRevoked(id, rec.cluster, rec.expires, ReasonReportedDeleted, false)
		}
		if p, ok := r.pending[id]; ok && ClusterRef(p.grant).NamespacedName == cluster.NamespacedName {
			// A removal is one stream's word, and every stream of the
			// cluster is sent the pending ids: the revoke stays pending,
			// and recorded, until every agent instance confirms it.
			retry = append(retry, p)
		}
	}
	var take []*record
	use := usage{}
	if u := r.use[cluster.NamespacedName]; u != nil {
		use = *u
	}
	var taken []heldElsewhere
	for _, rec := range adds {
		id := rec.id
		if h, ok := r.heldElsewhere(id, cluster.NamespacedName); ok {
			taken = append(taken, h)
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
			retry = append(retry, p)
			continue
		}
		if p, ok := r.pending[id]; ok {
			retry = append(retry, p)
		}
		if old, ok := r.live[id]; ok {
			use.bytes += rec.size - old.size
		} else {
			use.grants++
			use.bytes += rec.size
		}
		take = append(take, rec)
	}
	var err error
	switch {
	case use.grants > r.cfg.MaxGrantsPerCluster:
		err = r.refuse(cluster, frame, "clusterGrants", use.grants, r.cfg.MaxGrantsPerCluster,
			fmt.Errorf("%d live grants for ClusterProfile %s, more than the %d it may have: %w",
				use.grants, cluster, r.cfg.MaxGrantsPerCluster, errdefs.ErrResourceExhausted))
	case use.bytes > r.cfg.MaxGrantBytesPerCluster:
		err = r.refuse(cluster, frame, "clusterBytes", use.bytes, r.cfg.MaxGrantBytesPerCluster,
			fmt.Errorf("%d bytes of grants for ClusterProfile %s, more than the %d it may have: %w",
				use.bytes, cluster, r.cfg.MaxGrantBytesPerCluster, errdefs.ErrResourceExhausted))
	default:
		for _, rec := range take {
			r.drop(rec.id)
			r.put(rec)
		}
	}
	r.mu.Unlock()
	if len(taken) > 0 {
		// One line per report, so that an agent cannot fill the log.
		r.cfg.Log.Info("agent reported the credential id of another ClusterProfile's grant; ignored it",
			"cluster", cluster.String(), "holder", taken[0].holder.String(), "credentialID", taken[0].id,
			"state", taken[0].state, "frame", frame, "ignored", len(taken))
	}
	r.sendAgain(ctx, retry, false)
	if len(stale) > 0 {
		go r.revokeStale(context.WithoutCancel(ctx), cluster, stale)
	}
	return err
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
		"in", what, "credentialID", foreign[0].id, "holder", foreign[0].holder.String(), "state", foreign[0].state,
		"ignored", len(foreign))
}

// refuse logs a report of an agent of cluster, in frame, that breaks bound
// (size against max), and returns err, which says so to the agent.
func (r *Registry) refuse(cluster fleet.ClusterRef, frame, bound string, size, max int, err error) error {
	r.cfg.Log.Info("agent grant report refused; closing the stream",
		"cluster", cluster.String(), "frame", frame, "bound", bound, "size", size, "max", max)
	return fmt.Errorf("the %s holds %w", frame, err)
}

// revokeStale revokes the grants of ids, of an earlier incarnation of
// cluster, through the agent of cluster that reported them. If that fails,
// the agent's next hello reports them again.
func (r *Registry) revokeStale(ctx context.Context, cluster fleet.ClusterRef, ids []string) {
	if _, err := r.cfg.Revoker.Revoke(ctx, cluster, ids, ReasonClusterProfileReplaced); err != nil {
		r.cfg.Log.Info("revoke of a replaced ClusterProfile's grants not delivered; it is sent again at the agent's next hello",
			"cluster", cluster.String(), "grants", len(ids), "reason", err.Error())
	}
}

// ReasonReportedDeleted is the reason of a revoke sent again for a grant
// that an agent reported deleted, and an agent then reported live.
const ReasonReportedDeleted = "an agent reported the grant deleted"

// ReasonClusterProfileReplaced is the reason of the revokes of grants minted
// through an earlier incarnation of a ClusterProfile.
const ReasonClusterProfileReplaced = "the ClusterProfile was deleted and created again"

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

// Select returns copies of the live grants that s matches, ordered by
// ClusterProfile, then expiration time, then credential id. It reads the
// grants of s's credential id, username or ClusterProfile, whichever it
// names first, and holds the lock for one ClusterProfile's grants at a
// time: a selector that names none of them reads every ClusterProfile's
// grants in turn. Copies are made off the lock.
func (r *Registry) Select(s Selector) []*pb.Grant {
	now := r.cfg.Clock.Now()
	var picked []*pb.Grant
	collect := func(recs map[string]*record) {
		for _, rec := range recs {
			if rec.expires.After(now) && s.matches(rec.grant) {
				picked = append(picked, rec.grant)
			}
		}
	}
	r.mu.RLock()
	switch {
	case s.CredentialID != "":
		if rec, ok := r.live[s.CredentialID]; ok {
			collect(map[string]*record{rec.id: rec})
		}
		r.mu.RUnlock()
	case s.Username != "":
		collect(r.byUser[s.Username])
		r.mu.RUnlock()
	case s.Cluster.Name != "":
		collect(r.byCluster[s.Cluster])
		r.mu.RUnlock()
	default:
		clusters := make([]types.NamespacedName, 0, len(r.byCluster))
		for c := range r.byCluster {
			if s.Cluster.Namespace == "" || c.Namespace == s.Cluster.Namespace {
				clusters = append(clusters, c)
			}
		}
		r.mu.RUnlock()
		for _, c := range clusters {
			r.mu.RLock()
			collect(r.byCluster[c])
			r.mu.RUnlock()
		}
	}
	out := make([]*pb.Grant, len(picked))
	for i, g := range picked {
		out[i] = proto.Clone(g).(*pb.Grant)
	}
	slices.SortFunc(out, func(a, b *pb.Grant) int {
		return cmp.Or(
			cmp.Compare(a.GetCluster().GetNamespace(), b.GetCluster().GetNamespace()),
			cmp.Compare(a.GetCluster().GetName(), b.GetCluster().GetName()),
			a.GetExpirationTime().AsTime().Compare(b.GetExpirationTime().AsTime()),
			cmp.Compare(a.GetCredentialId(), b.GetCredentialId()),
		)
	})
	return out
}

// Live returns the grant of credentialID while its token may be used: it
// is live, unexpired, and no revoke of it is recorded or pending here. The
// grant is shared; the caller must not change it.
func (r *Registry) Live(credentialID string) (*pb.Grant, bool) {
	now := r.cfg.Clock.Now()
	r.mu.RLock()
	defer r.mu.RUnlock()
	rec, ok := r.live[credentialID]
	if !ok || !rec.expires.After(now) {
		return nil, false
	}
	if _, ok := r.pending[credentialID]; ok {
		return nil, false
	}
	if _, ok := r.revoked[credentialID]; ok {
		return nil, false
	}
	return rec.grant, true
}

// Revoked reports whether the token of credentialID was revoked, or its
// grant deleted, as far as this replica knows.
func (r *Registry) Revoked(credentialID string) bool {
	now := r.cfg.Clock.Now()
	r.mu.RLock()
	defer r.mu.RUnlock()
	if rec, ok := r.revoked[credentialID]; ok {
		return rec.expires.After(now)
	}
	p, ok := r.pending[credentialID]
	return ok && p.grant.GetExpirationTime().AsTime().After(now)
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
				"cluster", cluster.String(), "grants", len(ids), "reason", err.Error())
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
