package spoke

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/credbroker/credbroker/pkg/errdefs"
)

// A grant the spoke refuses tells the broker's caller why, in words it
// can act on: a namespace's Secret quota is not the agent's RBAC.
func TestCreateGrantErrorNamesTheCause(t *testing.T) {
	secrets := schema.GroupResource{Resource: "secrets"}
	for _, tc := range []struct {
		name string
		err  error
		is   error
		says string
	}{
		{"quota", apierrors.NewForbidden(secrets, "", errors.New("exceeded quota: secrets, requested: count/secrets=1, used: count/secrets=3, limited: count/secrets=3")),
			errdefs.ErrResourceExhausted, "ResourceQuota of namespace ns"},
		{"rbac", apierrors.NewForbidden(secrets, "", errors.New("User cannot create resource")),
			errdefs.ErrUnavailable, "grant the agent's ServiceAccount create on secrets"},
		{"other", apierrors.NewInternalError(errors.New("etcd down")), errdefs.ErrUnavailable, "so no token is minted"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := createGrantError(context.Background(), "ns", tc.err)
			assert.ErrorIs(t, err, tc.is)
			assert.Contains(t, err.Error(), tc.says)
		})
	}
}
