package grants

import (
	"context"

	authorizationv1 "k8s.io/api/authorization/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// AccessReviewer creates hub SubjectAccessReviews, for the Service and the
// Triggers; the broker passes the hub client's SubjectAccessReviews().
type AccessReviewer interface {
	Create(ctx context.Context, review *authorizationv1.SubjectAccessReview, opts metav1.CreateOptions) (*authorizationv1.SubjectAccessReview, error)
}

// Table is what the Service and the Triggers need of a Registry.
type Table interface {
	Select(s Selector) []*pb.Grant
	Revoke(ctx context.Context, grants []*pb.Grant, reason string) (revoked, pending []*pb.Grant)
	// RevokeRecorded is Revoke that fails when the pending revokes could
	// not be recorded for every broker replica to send again.
	RevokeRecorded(ctx context.Context, grants []*pb.Grant, reason string) (revoked, pending []*pb.Grant, err error)
}
