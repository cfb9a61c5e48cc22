package errdefs

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The sentinel errors. Each maps to exactly one gRPC code.
var (
	// ErrUnauthenticated: the caller's credential is missing, malformed,
	// expired or for the wrong audience.
	ErrUnauthenticated = errors.New("unauthenticated")
	// ErrPermissionDenied: hub RBAC or spoke policy refuses the request.
	ErrPermissionDenied = errors.New("permission denied")
	// ErrNotFound: the ClusterProfile or the spoke ServiceAccount is missing.
	ErrNotFound = errors.New("not found")
	// ErrInvalidArgument: the request is malformed.
	ErrInvalidArgument = errors.New("invalid argument")
	// ErrFailedPrecondition: the request is valid but ambiguous in the
	// current state, such as several ServiceAccounts allowing the caller.
	ErrFailedPrecondition = errors.New("failed precondition")
	// ErrUnavailable: a dependency is unreachable, such as the hub API server
	// or every agent of a cluster.
	ErrUnavailable = errors.New("unavailable")
	// ErrDeadlineExceeded: an agent did not answer in time.
	ErrDeadlineExceeded = errors.New("deadline exceeded")
	// ErrResourceExhausted: the caller sent too many requests.
	ErrResourceExhausted = errors.New("resource exhausted")
)

var codeOf = []struct {
	err  error
	code codes.Code
}{
	{ErrUnauthenticated, codes.Unauthenticated},
	{ErrPermissionDenied, codes.PermissionDenied},
	{ErrNotFound, codes.NotFound},
	{ErrInvalidArgument, codes.InvalidArgument},
	{ErrFailedPrecondition, codes.FailedPrecondition},
	{ErrUnavailable, codes.Unavailable},
	{ErrDeadlineExceeded, codes.DeadlineExceeded},
	{ErrResourceExhausted, codes.ResourceExhausted},
}

// InternalMessage is what a caller reads for an error that matches no
// sentinel. The detail stays in the server's log.
const InternalMessage = "internal error; the server log has the detail"

// Code returns the gRPC code for err: the code of the first sentinel it
// wraps, the code of a *Coded error, DeadlineExceeded or Canceled for the
// context errors, OK for nil, and Internal otherwise.
func Code(err error) codes.Code {
	if err == nil {
		return codes.OK
	}
	var c *Coded
	if errors.As(err, &c) {
		return c.code
	}
	for _, s := range codeOf {
		if errors.Is(err, s.err) {
			return s.code
		}
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return codes.DeadlineExceeded
	case errors.Is(err, context.Canceled):
		return codes.Canceled
	}
	return codes.Internal
}

// ToStatus turns err into the gRPC status a caller receives. The message is
// err's own text, except for Internal, whose detail is replaced by
// InternalMessage.
func ToStatus(err error) *status.Status {
	code := Code(err)
	switch code {
	case codes.OK:
		return status.New(codes.OK, "")
	case codes.Internal, codes.Unknown:
		return status.New(codes.Internal, InternalMessage)
	}
	return status.New(code, err.Error())
}

// Coded is an error that arrived with a gRPC code from elsewhere, such as an
// agent's Error frame. It wraps the matching sentinel, so errors.Is works.
type Coded struct {
	code codes.Code
	msg  string
}

// FromCode returns an error that carries code and msg. Codes outside the
// table above keep their value but wrap no sentinel.
func FromCode(code codes.Code, msg string) error {
	return &Coded{code: code, msg: msg}
}

func (c *Coded) Error() string { return c.msg }

// Unwrap returns the sentinel for the code, if there is one.
func (c *Coded) Unwrap() error {
	for _, s := range codeOf {
		if s.code == c.code {
			return s.err
		}
	}
	return nil
}
