package broker

import (
	"context"
	"fmt"
	"runtime/debug"

	"github.com/go-logr/logr"
	"google.golang.org/grpc"

	"github.com/credbroker/credbroker/pkg/errdefs"
)

// A panic in a handler must not take the broker down with every other
// consumer's call. The interceptors turn it into codes.Internal and log the
// stack, but not the panic value, which might hold request data.

func recoverUnary(log logr.Logger) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp any, err error) {
		defer func() {
			if r := recover(); r != nil {
				err = panicked(log, info.FullMethod, r)
			}
		}()
		return handler(ctx, req)
	}
}

func recoverStream(log logr.Logger) grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) (err error) {
		defer func() {
			if r := recover(); r != nil {
				err = panicked(log, info.FullMethod, r)
			}
		}()
		return handler(srv, ss)
	}
}

func panicked(log logr.Logger, method string, r any) error {
	log.Error(nil, "handler panicked", "method", method, "panicType", fmt.Sprintf("%T", r), "stack", string(debug.Stack()))
	return errdefs.ToStatus(fmt.Errorf("%s panicked", method)).Err()
}
