package grants

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/protobuf/proto"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/pkg/tunnel"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// Revoker asks the agent of cluster to delete the grants of ids, and returns
// the ids whose grants are gone: deleted now, or before. Errors wrap
// errdefs sentinels; ErrUnavailable when no agent of cluster is connected.
// The broker passes the tunnel server.
type Revoker interface {
	Revoke(ctx context.Context, cluster tunnel.ClusterRef, ids []string, reason string) ([]string, error)
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
func ClusterRef(g *pb.Grant) tunnel.ClusterRef {
	return tunnel.ClusterRef{
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
	// MaxGrantsPerCluster bounds the live grants held for one
	// ClusterProfile, so that a compromised agent cannot grow the broker's
	// memory without bound; reports beyond it are dropped and logged.
	// Default DefaultMaxGrantsPerCluster.
	MaxGrantsPerCluster int
	// Log receives revocations that failed. Default: discard.
	Log logr.Logger
}

// DefaultMaxGrantsPerCluster is the default RegistryConfig.MaxGrantsPerCluster:
// far more tokens than one cluster's consumers hold at once.
const DefaultMaxGrantsPerCluster = 100000

// pendingRevoke is a revoke that has not reached an agent yet.
type pendingRevoke struct {
	grant  *pb.Grant
	reason string
}

// Registry holds the live grants of the fleet as the agents report them,
// and revokes them. It is safe for concurrent use.
type Registry struct {
	cfg RegistryConfig

	mu sync.Mutex
	// live holds the live grants by credential id; perCluster counts them
	// by ClusterProfile.
	live       map[string]*pb.Grant
	perCluster map[types.NamespacedName]int
	// lastExpire is when expire last ran.
	lastExpire time.Time
	// revoked holds the grants revoked through this replica or reported
	// deleted by an agent, by credential id, until their tokens expire.
	revoked map[string]*pb.Grant
	// pending holds the revokes that have not reached an agent, by
	// credential id.
	pending map[string]pendingRevoke
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
	return &Registry{
		cfg:        cfg,
		live:       map[string]*pb.Grant{},
		perCluster: map[types.NamespacedName]int{},
		revoked:    map[string]*pb.Grant{},
		pending:    map[string]pendingRevoke{},
	}, nil
}

// own returns a copy of g, of an agent of cluster, with the UID of cluster,
// and whether it belongs to cluster: the broker, not the agent, says which
// ClusterProfile a stream serves, so a grant recorded for another one is
// not taken. A grant recorded for another incarnation of cluster is stale:
// the ClusterProfile was replaced. It returns nil for a grant without a
// credential id or an expiry.
func own(cluster tunnel.ClusterRef, g *pb.Grant) (_ *pb.Grant, stale bool) {
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
// Update applies those of a GrantUpdate.
func (r *Registry) Hello(ctx context.Context, cluster tunnel.ClusterRef, grants []*pb.Grant) {
	r.Update(ctx, cluster, &pb.GrantUpdate{Added: grants})
}

// Update applies a report from an agent of cluster: the grants of its hello,
// or a GrantUpdate. It sends again the pending revokes of the grants
// it adds. A hello adds and never removes: the agents of one ClusterProfile
// may see different grants (one scoped to a namespace, or an agent on
// another cluster that holds the profile's SVID), and none may hide
// another's grants from List and Revoke. A grant leaves when an agent
// reports its deletion, when a revoke finds it gone, or when its token
// expires. It revokes, at once, the grants
// it adds that were minted through another incarnation of cluster: the
// ClusterProfile was deleted and created again since, and they are not the
// new one's.
func (r *Registry) Update(ctx context.Context, cluster tunnel.ClusterRef, u *pb.GrantUpdate) {
	now := r.cfg.Clock.Now()
	var (
		retry   []pendingRevoke
		stale   []string
		dropped int
	)
	r.mu.Lock()
	r.expire()
	for _, id := range u.GetRemoved() {
		if g, ok := r.live[id]; ok && ClusterRef(g).NamespacedName == cluster.NamespacedName {
			r.drop(id)
			r.revoked[id] = g
		}
		if p, ok := r.pending[id]; ok && ClusterRef(p.grant).NamespacedName == cluster.NamespacedName {
			delete(r.pending, id)
		}
	}
	for _, g := range u.GetAdded() {
		g, old := own(cluster, g)
		if g == nil || !g.GetExpirationTime().AsTime().After(now) {
			continue
		}
		if old {
			stale = append(stale, g.GetCredentialId())
			continue
		}
		id := g.GetCredentialId()
		if _, ok := r.revoked[id]; ok {
			// Reported by an agent that has not seen the delete yet.
			if p, ok := r.pending[id]; ok {
				retry = append(retry, p)
			}
			continue
		}
		if p, ok := r.pending[id]; ok {
			retry = append(retry, p)
		}
		if _, ok := r.live[id]; !ok && r.perCluster[cluster.NamespacedName] >= r.cfg.MaxGrantsPerCluster {
			dropped++
			continue
		}
		r.drop(id)
		r.put(id, g)
	}
	r.mu.Unlock()
	if dropped > 0 {
		r.cfg.Log.Info("agent reported more live grants than the registry keeps for one ClusterProfile; dropped the rest",
			"cluster", cluster.String(), "max", r.cfg.MaxGrantsPerCluster, "dropped", dropped)
	}
	if len(retry) > 0 {
		go r.retry(context.WithoutCancel(ctx), retry)
	}
	if len(stale) > 0 {
		go r.revokeStale(context.WithoutCancel(ctx), cluster, stale)
	}
}

// revokeStale revokes the grants of ids, of an earlier incarnation of
// cluster, through the agent of cluster that reported them. If that fails,
// the agent's next hello reports them again.
func (r *Registry) revokeStale(ctx context.Context, cluster tunnel.ClusterRef, ids []string) {
	if _, err := r.cfg.Revoker.Revoke(ctx, cluster, ids, ReasonClusterProfileReplaced); err != nil {
		r.cfg.Log.Info("revoke of a replaced ClusterProfile's grants not delivered; it is sent again at the agent's next hello",
			"cluster", cluster.String(), "grants", len(ids), "reason", err.Error())
	}
}

// ReasonClusterProfileReplaced is the reason of the revokes of grants minted
// through an earlier incarnation of a ClusterProfile.
const ReasonClusterProfileReplaced = "the ClusterProfile was deleted and created again"

func (r *Registry) retry(ctx context.Context, list []pendingRevoke) {
	byReason := map[string][]*pb.Grant{}
	for _, p := range list {
		byReason[p.reason] = append(byReason[p.reason], p.grant)
	}
	for reason, gs := range byReason {
		r.Revoke(ctx, gs, reason)
	}
}

// put adds g, of credential id id, to the live grants. r.mu is held.
func (r *Registry) put(id string, g *pb.Grant) {
	r.live[id] = g
	r.perCluster[ClusterRef(g).NamespacedName]++
}

// drop removes the live grant of id, if any. r.mu is held.
func (r *Registry) drop(id string) {
	g, ok := r.live[id]
	if !ok {
		return
	}
	delete(r.live, id)
	key := ClusterRef(g).NamespacedName
	if r.perCluster[key]--; r.perCluster[key] <= 0 {
		delete(r.perCluster, key)
	}
}

// expireEvery bounds how often expire scans every grant.
const expireEvery = time.Second

// expire drops what is known of tokens that have expired, at most once per
// expireEvery; readers skip expired grants themselves. r.mu is held.
func (r *Registry) expire() {
	now := r.cfg.Clock.Now()
	if now.Sub(r.lastExpire) < expireEvery && !now.Before(r.lastExpire) {
		return
	}
	r.lastExpire = now
	for id, g := range r.live {
		if !g.GetExpirationTime().AsTime().After(now) {
			r.drop(id)
		}
	}
	for id, g := range r.revoked {
		if !g.GetExpirationTime().AsTime().After(now) {
			delete(r.revoked, id)
		}
	}
	for id, p := range r.pending {
		if !p.grant.GetExpirationTime().AsTime().After(now) {
			delete(r.pending, id)
		}
	}
}

// Select returns copies of the live grants that s matches, ordered by
// ClusterProfile, then expiration time, then credential id.
func (r *Registry) Select(s Selector) []*pb.Grant {
	r.mu.Lock()
	r.expire()
	now := r.cfg.Clock.Now()
	var out []*pb.Grant
	for _, g := range r.live {
		if s.matches(g) && g.GetExpirationTime().AsTime().After(now) {
			out = append(out, proto.Clone(g).(*pb.Grant))
		}
	}
	r.mu.Unlock()
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

// Revoked reports whether the token of credentialID was revoked, or its
// grant deleted, as far as this replica knows.
func (r *Registry) Revoked(credentialID string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	g, ok := r.revoked[credentialID]
	if !ok {
		p, ok := r.pending[credentialID]
		if !ok {
			return false
		}
		g = p.grant
	}
	return g.GetExpirationTime().AsTime().After(r.cfg.Clock.Now())
}

// Revoke asks the agents to delete grants, one request per ClusterProfile
// incarnation. It returns the grants now gone, and those whose agent could
// not be reached or failed: those stay pending, and are revoked when their
// agent reports them again. Both keep the order of grants within each
// ClusterProfile, and the ClusterProfiles in the order they first appear.
// From the call on, Revoked reports every one of grants as revoked.
func (r *Registry) Revoke(ctx context.Context, grants []*pb.Grant, reason string) (revoked, pending []*pb.Grant) {
	byCluster := map[tunnel.ClusterRef][]*pb.Grant{}
	var clusters []tunnel.ClusterRef
	r.mu.Lock()
	for _, g := range grants {
		r.pending[g.GetCredentialId()] = pendingRevoke{grant: g, reason: reason}
		c := ClusterRef(g)
		if _, ok := byCluster[c]; !ok {
			clusters = append(clusters, c)
		}
		byCluster[c] = append(byCluster[c], g)
	}
	r.mu.Unlock()
	for _, cluster := range clusters {
		gs := byCluster[cluster]
		ids := make([]string, len(gs))
		for i, g := range gs {
			ids[i] = g.GetCredentialId()
		}
		gone, err := r.cfg.Revoker.Revoke(ctx, cluster, ids, reason)
		if err != nil {
			r.cfg.Log.Info("revoke not delivered; it is sent again when the agent reports the grants",
				"cluster", cluster.String(), "grants", len(ids), "reason", err.Error())
		}
		isGone := make(map[string]bool, len(gone))
		for _, id := range gone {
			isGone[id] = true
		}
		r.mu.Lock()
		for _, g := range gs {
			id := g.GetCredentialId()
			if !isGone[id] {
				pending = append(pending, g)
				continue
			}
			delete(r.pending, id)
			r.drop(id)
			r.revoked[id] = g
			revoked = append(revoked, g)
		}
		r.mu.Unlock()
	}
	return revoked, pending
}
