package tokenexchange

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	authorizationv1 "k8s.io/api/authorization/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/credbroker/credbroker/pkg/errdefs"
)

// The permission a consumer needs on the hub, per ClusterProfile.
const (
	Group       = "multicluster.x-k8s.io"
	Resource    = "clusterprofiles"
	Subresource = "token"
	Verb        = "create"
)

// authorize asks the hub whether user may create clusterprofiles/token for
// cluster. Allowed decisions are cached for AllowTTL, denials for DenyTTL.
func (s *Service) authorize(ctx context.Context, user userInfo, cluster types.NamespacedName) error {
	key, err := json.Marshal([]any{user, cluster.Namespace, cluster.Name})
	if err != nil {
		return fmt.Errorf("authorization cache key: %w", err)
	}
	sum := sha256.Sum256(key)
	allowed, hit, err := s.authz.Do(ctx, hex.EncodeToString(sum[:]), func(ctx context.Context) (bool, time.Time, error) {
		return s.accessReview(ctx, user, cluster)
	})
	cacheLookups.WithLabelValues("authz", cacheLabel(hit)).Inc()
	if err != nil {
		return err
	}
	if !allowed {
		return fmt.Errorf("hub RBAC does not allow %q to %s %s.%s/%s %q in namespace %q: %w",
			user.Username, Verb, Resource, Group, Subresource, cluster.Name, cluster.Namespace, errdefs.ErrPermissionDenied)
	}
	return nil
}

func (s *Service) accessReview(ctx context.Context, user userInfo, cluster types.NamespacedName) (bool, time.Time, error) {
	now := s.cfg.Clock.Now()
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ReviewTimeout)
	defer cancel()
	extra := make(map[string]authorizationv1.ExtraValue, len(user.Extra))
	for k, v := range user.Extra {
		extra[k] = authorizationv1.ExtraValue(v)
	}
	review, err := s.cfg.AccessReviews.Create(ctx, &authorizationv1.SubjectAccessReview{
		Spec: authorizationv1.SubjectAccessReviewSpec{
			User:   user.Username,
			UID:    user.UID,
			Groups: user.Groups,
			Extra:  extra,
			ResourceAttributes: &authorizationv1.ResourceAttributes{
				Group:       Group,
				Resource:    Resource,
				Subresource: Subresource,
				Verb:        Verb,
				Namespace:   cluster.Namespace,
				Name:        cluster.Name,
			},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		return false, time.Time{}, s.hubFailure("SubjectAccessReview", err)
	}
	if review.Status.Allowed && !review.Status.Denied {
		return true, now.Add(s.cfg.AllowTTL), nil
	}
	return false, now.Add(s.cfg.DenyTTL), nil
}

// hubFailure describes a failed hub review for the caller: the API status
// reason when the hub answered, else only that it did not. The full error,
// which may name the hub's address, goes to the log.
func (s *Service) hubFailure(review string, err error) error {
	s.cfg.Log.Error(err, "hub review failed", "review", review)
	reason := "the hub API server did not answer"
	if st, ok := err.(apierrors.APIStatus); ok {
		reason = fmt.Sprintf("%s (%d)", st.Status().Reason, st.Status().Code)
	} else if errors.Is(err, context.DeadlineExceeded) {
		reason = "the hub API server did not answer in time"
	}
	return fmt.Errorf("hub %s failed: %s: %w", review, reason, errdefs.ErrUnavailable)
}
