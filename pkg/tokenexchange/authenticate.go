package tokenexchange

import (
	"context"

	"github.com/credbroker/credbroker/pkg/hubauth"
)

// Authenticate authenticates the caller of a gRPC call as Exchange does:
// the "authorization: Bearer" metadata, checked by the Verifier, then by a
// cached hub TokenReview for the broker's audience, then the caller's rate
// limit, which it shares with its exchanges. Errors wrap errdefs sentinels:
// ErrUnauthenticated, ErrUnavailable or ErrResourceExhausted. Other
// services of the exchange port, such as Grants, use it.
func (s *Service) Authenticate(ctx context.Context) (hubauth.User, error) {
	bearer, err := bearerToken(ctx)
	if err != nil {
		return hubauth.User{}, err
	}
	user, err := s.authenticate(ctx, bearer)
	if err != nil {
		return hubauth.User{}, err
	}
	if err := s.allow(ctx, user, "calls"); err != nil {
		return hubauth.User{}, err
	}
	return user, nil
}
