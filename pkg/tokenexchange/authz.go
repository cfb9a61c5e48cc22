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

// authorize asks the hub whether user may create clusterprofiles/token for
// cluster. Allowed decisions are cached for AllowTTL, denials for DenyTTL.
func (s *Service) authorize(ctx context.Context, user hubauth.User, cluster types.NamespacedName) error {
	k := newKey()
	k.user(user)
	k.add(cluster.Namespace, cluster.Name)
	key := k.sum()
	allowed, hit := s.authz.Fresh(key)
	var err error
	if !hit {
		allowed, hit, err = s.reviewAccessOrWait(ctx, key, user, cluster)
	}
	s.metrics.lookedUp(authzCache, hit)
	if err != nil {
		return err
	}
	if !allowed {
		return fmt.Errorf("hub RBAC does not allow %q to %s %s.%s/%s %q in namespace %q: %w",
			user.Username, hubauth.VerbCreate, hubauth.Resource, hubauth.Group, hubauth.Subresource, cluster.Name, cluster.Namespace, errdefs.ErrPermissionDenied)
	}
	return nil
}

// reviewAccessOrWait is the authorization cache's Do for user and
// cluster, under key: the cached decision, or a SubjectAccessReview of its
// own or of a concurrent call.
func (s *Service) reviewAccessOrWait(ctx context.Context, key cacheKey, user hubauth.User, cluster types.NamespacedName) (allowed, hit bool, err error) {
	return s.authz.Do(ctx, key, func(ctx context.Context) (bool, time.Time, error) {
		if err := s.allow(ctx, user, "hub reviews and mints"); err != nil {
			return false, time.Time{}, err
		}
		return s.accessReview(ctx, user, cluster)
	})
}

func (s *Service) accessReview(ctx context.Context, user hubauth.User, cluster types.NamespacedName) (bool, time.Time, error) {
	now := s.cfg.Clock.Now()
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ReviewTimeout)
	defer cancel()
	review, err := s.cfg.AccessReviews.Create(ctx, hubauth.AccessReview(user, hubauth.VerbCreate, cluster), metav1.CreateOptions{})
	if err != nil {
		return false, time.Time{}, s.hubFailure("SubjectAccessReview", err)
	}
	if hubauth.Allowed(review) {
		return true, now.Add(s.cfg.AllowTTL), nil
	}
	return false, now.Add(s.cfg.DenyTTL), nil
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
