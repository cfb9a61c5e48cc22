package tokenexchange

import (
	"context"
	"errors"
	"fmt"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/hubauth"
)

// authzDecision is a cached SubjectAccessReview outcome.
type authzDecision struct {
	allowed bool
	// seq is the number of the review (forgets.next).
	seq uint64
}

// authorize asks the hub whether user may create clusterprofiles/token for
// cluster. Allowed decisions are cached for AllowTTL, denials for DenyTTL,
// and neither outlives a change of hub RBAC or of the user's hub
// ServiceAccount (RBACChanged, SubjectChanged).
func (s *Service) authorize(ctx context.Context, user hubauth.User, cluster types.NamespacedName) error {
	k := newKey()
	k.user(user)
	k.add(cluster.Namespace, cluster.Name)
	key := k.sum()
	stale := func(d authzDecision) bool { return s.forgets.authorizationStale(user.Username, d.seq) }
	d, hit := s.authz.Fresh(key)
	hit = hit && !stale(d)
	var err error
	if !hit {
		d, hit, err = freshDecision(ctx, s.authz, key, stale, func(ctx context.Context) (authzDecision, time.Time, error) {
			if err := s.allow(ctx, user, "hub reviews and mints"); err != nil {
				return authzDecision{}, time.Time{}, err
			}
			return s.accessReview(ctx, user, cluster)
		})
	}
	s.metrics.lookedUp(authzCache, hit)
	if err != nil {
		return err
	}
	if !d.allowed {
		return fmt.Errorf("hub RBAC does not allow %q to %s %s.%s/%s %q in namespace %q: %w",
			user.Username, hubauth.VerbCreate, hubauth.Resource, hubauth.Group, hubauth.Subresource, cluster.Name, cluster.Namespace, errdefs.ErrPermissionDenied)
	}
	return nil
}

func (s *Service) accessReview(ctx context.Context, user hubauth.User, cluster types.NamespacedName) (authzDecision, time.Time, error) {
	now := s.cfg.Clock.Now()
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ReviewTimeout)
	defer cancel()
	seq := s.forgets.next()
	review, err := s.cfg.AccessReviews.Create(ctx, hubauth.AccessReview(user, hubauth.VerbCreate, cluster), metav1.CreateOptions{})
	if err != nil {
		return authzDecision{}, time.Time{}, s.hubFailure("SubjectAccessReview", err)
	}
	if hubauth.Allowed(review) {
		return authzDecision{allowed: true, seq: seq}, now.Add(s.cfg.AllowTTL), nil
	}
	return authzDecision{seq: seq}, now.Add(s.cfg.DenyTTL), nil
}

// hubFailure describes a failed hub review for the caller: the API status
// reason when the hub answered, else only that it did not. The full error,
// which may name the hub's address, goes to the log.
func (s *Service) hubFailure(review string, err error) error {
	s.cfg.Log.Error(err, "hub review failed", fleet.LogReview, review)
	reason := "the hub API server did not answer"
	if st, ok := err.(apierrors.APIStatus); ok {
		reason = fmt.Sprintf("%s (%d)", st.Status().Reason, st.Status().Code)
	} else if errors.Is(err, context.DeadlineExceeded) {
		reason = "the hub API server did not answer in time"
	}
	return fmt.Errorf("hub %s failed: %s: %w", review, reason, errdefs.ErrUnavailable)
}
