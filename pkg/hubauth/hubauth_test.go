package hubauth_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/credbroker/credbroker/pkg/hubauth"
)

// Attack: a review that asks about the username alone makes a grant to a
// group never apply, and hides the uid and extra (pod binding) that a hub
// authorizer may deny on.
// Defence: AccessReview carries every field of the user.
func TestAccessReviewCarriesEveryField(t *testing.T) {
	u := hubauth.User{
		Username: "system:serviceaccount:apps:deployer",
		UID:      "uid-1",
		Groups:   []string{"system:serviceaccounts", "system:serviceaccounts:apps"},
		Extra: map[string]authenticationv1.ExtraValue{
			"authentication.kubernetes.io/pod-name": {"deployer-0"},
			"authentication.kubernetes.io/pod-uid":  {"pod-uid"},
		},
	}
	got := hubauth.AccessReview(u, "create", types.NamespacedName{Namespace: "fleet", Name: "spoke-1"})
	assert.Equal(t, authorizationv1.SubjectAccessReviewSpec{
		User:   "system:serviceaccount:apps:deployer",
		UID:    "uid-1",
		Groups: []string{"system:serviceaccounts", "system:serviceaccounts:apps"},
		Extra: map[string]authorizationv1.ExtraValue{
			"authentication.kubernetes.io/pod-name": {"deployer-0"},
			"authentication.kubernetes.io/pod-uid":  {"pod-uid"},
		},
		ResourceAttributes: &authorizationv1.ResourceAttributes{
			Group: "multicluster.x-k8s.io", Resource: "clusterprofiles", Subresource: "token",
			Verb: "create", Namespace: "fleet", Name: "spoke-1",
		},
	}, got.Spec)
}

func TestAllowed(t *testing.T) {
	tests := []struct {
		name   string
		review *authorizationv1.SubjectAccessReview
		want   bool
	}{
		{name: "no answer", review: nil},
		{name: "no opinion", review: &authorizationv1.SubjectAccessReview{}},
		{name: "allowed", review: &authorizationv1.SubjectAccessReview{Status: authorizationv1.SubjectAccessReviewStatus{Allowed: true}}, want: true},
		{name: "denied", review: &authorizationv1.SubjectAccessReview{Status: authorizationv1.SubjectAccessReviewStatus{Denied: true}}},
		{name: "allowed and denied", review: &authorizationv1.SubjectAccessReview{Status: authorizationv1.SubjectAccessReviewStatus{Allowed: true, Denied: true}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, hubauth.Allowed(tt.review))
		})
	}
}
