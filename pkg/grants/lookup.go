package grants

import (
	"cmp"
	"slices"

	"google.golang.org/protobuf/proto"
	"k8s.io/apimachinery/pkg/types"

	"github.com/credbroker/credbroker/pkg/fleet"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

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
