package spoke

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// Only the API server's NotFound for a Secret is a deleted grant: a
// NotFound for the ServiceAccount stays NotFound.
func TestGrantDeleted(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want bool
	}{
		{name: "grant Secret not found", err: apierrors.NewNotFound(secretsResource, "credbroker-grant-x"), want: true},
		{name: "wrapped", err: fmt.Errorf("post: %w", apierrors.NewNotFound(secretsResource, "credbroker-grant-x")), want: true},
		{name: "ServiceAccount not found", err: apierrors.NewNotFound(schema.GroupResource{Resource: "serviceaccounts"}, "deployer")},
		{name: "a secrets resource of another group", err: apierrors.NewNotFound(schema.GroupResource{Group: "example.com", Resource: "secrets"}, "x")},
		{name: "grant Secret replaced", err: apierrors.NewConflict(schema.GroupResource{Resource: "Secret"}, "credbroker-grant-x", errors.New("UID differs"))},
		{name: "NotFound without details", err: func() error {
			e := apierrors.NewNotFound(secretsResource, "x")
			e.ErrStatus.Details = nil
			return e
		}()},
		{name: "not an API error", err: errors.New("connection refused")},
		{name: "no error"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, grantDeleted(tt.err))
		})
	}
}
