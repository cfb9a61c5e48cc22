package grants

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/hubauth"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// access is what one SubjectAccessReview decides: a hub subject, as the
// grant recorded it, and a ClusterProfile.
type access struct {
	username, uid string
	// groups are the subject's groups, sorted and joined with newlines
	// (a group name holds no newline), so that equal sets compare equal.
	groups  string
	cluster types.NamespacedName
}

func accessOf(g *pb.Grant) access {
	groups := slices.Clone(g.GetSubject().GetGroups())
	slices.Sort(groups)
	return access{
		username: g.GetSubject().GetUsername(),
		uid:      g.GetSubject().GetUid(),
		groups:   strings.Join(slices.Compact(groups), "\n"),
		cluster:  ClusterRef(g).NamespacedName,
	}
}

func (a access) user() hubauth.User {
	u := hubauth.User{Username: a.username, UID: a.uid}
	if a.groups != "" {
		u.Groups = strings.Split(a.groups, "\n")
	}
	return u
}

// checkRBAC asks the hub, once per distinct subject and ClusterProfile,
// whether the subject of each live grant may still create
// clusterprofiles/token on its ClusterProfile, and revokes the grants it no
// longer may. The reviews are those of the exchange (hubauth.AccessReview,
// verb create) but for the subject's extra attributes, which grants do not
// record; RBAC does not read them. A review that fails revokes nothing; when
// the hub does not answer at all, the check stops there and is made again at
// the next change or sweep.
func (t *Triggers) checkRBAC(ctx context.Context) {
	byAccess := map[access][]*pb.Grant{}
	var order []access
	for _, g := range t.cfg.Grants.Select(Selector{}) {
		a := accessOf(g)
		if a.username == "" {
			continue // nothing to ask about; the exchange never mints so
		}
		if _, ok := byAccess[a]; !ok {
			order = append(order, a)
		}
		byAccess[a] = append(byAccess[a], g)
	}
	for _, a := range order {
		if err := t.limiter.Wait(ctx); err != nil {
			return // ctx ended
		}
		allowed, err := t.review(ctx, a)
		if err != nil {
			t.cfg.Log.Info("hub RBAC check of grants failed; checked again at the next RBAC change or sweep",
				fleet.LogSubject, a.username, fleet.LogCluster, a.cluster.String(), fleet.LogGrants, len(byAccess[a]), fleet.LogErr, err.Error())
			var status apierrors.APIStatus
			if !errors.As(err, &status) {
				return // the hub did not answer: do not wait on it for every subject
			}
			continue
		}
		if !allowed {
			t.revoke(ctx, "rbac", byAccess[a], fmt.Sprintf("hub RBAC no longer allows %s to %s %s.%s/%s %s in namespace %s",
				a.username, hubauth.VerbCreate, hubauth.Resource, hubauth.Group, hubauth.Subresource, a.cluster.Name, a.cluster.Namespace))
		}
	}
}

func (t *Triggers) review(ctx context.Context, a access) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, t.cfg.ReviewTimeout)
	defer cancel()
	review, err := t.cfg.AccessReviews.Create(ctx, hubauth.AccessReview(a.user(), hubauth.VerbCreate, a.cluster), metav1.CreateOptions{})
	if err != nil {
		return false, fmt.Errorf("SubjectAccessReview: %w", err)
	}
	return hubauth.Allowed(review), nil
}
