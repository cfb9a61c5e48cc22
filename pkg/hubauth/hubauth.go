package hubauth

import (
	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	"k8s.io/apimachinery/pkg/types"
)

// The resource a consumer needs hub RBAC on, per ClusterProfile.
const (
	Group       = "multicluster.x-k8s.io"
	Resource    = "clusterprofiles"
	Subresource = "token"
)

// The verbs on Resource/Subresource: create to exchange, list and delete to
// see and revoke other consumers' grants.
const (
	VerbCreate = "create"
	VerbList   = "list"
	VerbDelete = "delete"
)

// User is a hub identity as the hub's TokenReview reported it.
type User struct {
	Username string
	UID      string
	Groups   []string
	Extra    map[string]authenticationv1.ExtraValue
}

// AccessReview returns the SubjectAccessReview that asks whether u may verb
// multicluster.x-k8s.io clusterprofiles/token of cluster, with u's
// username, uid, groups and extra.
func AccessReview(u User, verb string, cluster types.NamespacedName) *authorizationv1.SubjectAccessReview {
	extra := make(map[string]authorizationv1.ExtraValue, len(u.Extra))
	for k, v := range u.Extra {
		extra[k] = authorizationv1.ExtraValue(v)
	}
	return &authorizationv1.SubjectAccessReview{
		Spec: authorizationv1.SubjectAccessReviewSpec{
			User:   u.Username,
			UID:    u.UID,
			Groups: u.Groups,
			Extra:  extra,
			ResourceAttributes: &authorizationv1.ResourceAttributes{
				Group:       Group,
				Resource:    Resource,
				Subresource: Subresource,
				Verb:        verb,
				Namespace:   cluster.Namespace,
				Name:        cluster.Name,
			},
		},
	}
}

// Allowed reports whether a SubjectAccessReview's answer allows: allowed,
// and not denied.
func Allowed(review *authorizationv1.SubjectAccessReview) bool {
	return review != nil && review.Status.Allowed && !review.Status.Denied
}
