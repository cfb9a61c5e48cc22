package tokenexchange

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/credbroker/credbroker/pkg/errdefs"
)

// Authenticate is the exchange's authentication, for the other services of
// the exchange port.
func TestAuthenticate(t *testing.T) {
	f := newFixture(t)
	user, err := f.svc.Authenticate(withBearer(consumerToken))
	require.NoError(t, err)
	assert.Equal(t, "system:serviceaccount:hub:consumer", user.Username)
	assert.Equal(t, "consumer-uid", user.UID)
	assert.Equal(t, []string{"system:serviceaccounts"}, user.Groups)

	_, err = f.svc.Authenticate(context.Background())
	require.ErrorIs(t, err, errdefs.ErrUnauthenticated)
	_, err = f.svc.Authenticate(withBearer("not-a-jwt"))
	require.ErrorIs(t, err, errdefs.ErrUnauthenticated)
}
