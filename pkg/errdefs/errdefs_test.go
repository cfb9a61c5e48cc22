package errdefs

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"google.golang.org/grpc/codes"
)

func TestToStatus(t *testing.T) {
	tests := []struct {
		name     string
		err      error
		wantCode codes.Code
		wantMsg  string
	}{
		{name: "nil", err: nil, wantCode: codes.OK, wantMsg: ""},
		{name: "wrapped sentinel", err: fmt.Errorf("clusterprofile fleet/a: %w", ErrNotFound), wantCode: codes.NotFound, wantMsg: "clusterprofile fleet/a: not found"},
		{name: "doubly wrapped", err: fmt.Errorf("exchange: %w", fmt.Errorf("rbac says no: %w", ErrPermissionDenied)), wantCode: codes.PermissionDenied, wantMsg: "exchange: rbac says no: permission denied"},
		{name: "deadline", err: fmt.Errorf("mint: %w", context.DeadlineExceeded), wantCode: codes.DeadlineExceeded, wantMsg: "mint: context deadline exceeded"},
		{name: "canceled", err: context.Canceled, wantCode: codes.Canceled, wantMsg: "context canceled"},
		{name: "internal detail is hidden", err: errors.New("dial 10.0.0.1: secret"), wantCode: codes.Internal, wantMsg: InternalMessage},
		{name: "coded from an agent", err: fmt.Errorf("cluster a: %w", FromCode(codes.FailedPrecondition, "agent: name one")), wantCode: codes.FailedPrecondition, wantMsg: "cluster a: agent: name one"},
		{name: "coded internal is hidden", err: FromCode(codes.Internal, "agent: secret"), wantCode: codes.Internal, wantMsg: InternalMessage},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			st := ToStatus(tt.err)
			assert.Equal(t, tt.wantCode, st.Code())
			assert.Equal(t, tt.wantMsg, st.Message())
		})
	}
}

func TestFromCodeWrapsSentinel(t *testing.T) {
	for _, s := range codeOf {
		err := FromCode(s.code, "x")
		assert.ErrorIs(t, err, s.err)
		assert.Equal(t, s.code, Code(err))
	}
	assert.NoError(t, errors.Unwrap(FromCode(codes.Aborted, "x")))
	assert.Equal(t, codes.Aborted, Code(FromCode(codes.Aborted, "x")))
}
