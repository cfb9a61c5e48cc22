package agent

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// The TokenRequest counter's code is the spoke API server's HTTP status.
func TestStatusCode(t *testing.T) {
	sa := schema.GroupResource{Resource: "serviceaccounts"}
	tests := []struct {
		err  error
		want string
	}{
		{nil, "201"},
		{apierrors.NewForbidden(sa, "x", errors.New("no")), "403"},
		{apierrors.NewNotFound(sa, "x"), "404"},
		{apierrors.NewTooManyRequests("slow down", 1), "429"},
		{context.DeadlineExceeded, "error"},
	}
	for _, tt := range tests {
		assert.Equal(t, tt.want, statusCode(tt.err), "%v", tt.err)
	}
}
