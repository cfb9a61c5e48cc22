package errdefs

import (
	"context"
	"errors"
	"strconv"
	"time"

	"google.golang.org/grpc/metadata"
)

// RetryAfterKey is the gRPC trailer that tells a caller refused with
// ResourceExhausted how long to wait before it tries again: whole seconds,
// rounded up, at least 1, as in HTTP's Retry-After. The error message says
// the same in words.
const RetryAfterKey = "retry-after"

// retryAfter is an error that knows when the caller may retry.
type retryAfter struct {
	err  error
	wait time.Duration
}

func (e *retryAfter) Error() string { return e.err.Error() }
func (e *retryAfter) Unwrap() error { return e.err }

// WithRetryAfter returns err, which keeps its code, marked with the wait
// after which the caller may retry.
func WithRetryAfter(err error, wait time.Duration) error {
	return &retryAfter{err: err, wait: wait}
}

// RetryAfter returns the wait that err carries, if any.
func RetryAfter(err error) (time.Duration, bool) {
	var r *retryAfter
	if errors.As(err, &r) {
		return r.wait, true
	}
	return 0, false
}

// RetryAfterSeconds rounds wait up to whole seconds, at least 1.
func RetryAfterSeconds(wait time.Duration) int64 {
	return max(1, int64((wait+time.Second-1)/time.Second))
}

// RetryAfterTrailer is the trailer that carries wait.
func RetryAfterTrailer(wait time.Duration) metadata.MD {
	return metadata.Pairs(RetryAfterKey, strconv.FormatInt(RetryAfterSeconds(wait), 10))
}

// ParseRetryAfter reads the wait from a trailer. It reports false when
// the trailer holds no single positive number of seconds.
func ParseRetryAfter(md metadata.MD) (time.Duration, bool) {
	v := md.Get(RetryAfterKey)
	if len(v) != 1 {
		return 0, false
	}
	n, err := strconv.ParseInt(v[0], 10, 64)
	if err != nil || n <= 0 || n > int64(24*time.Hour/time.Second) {
		return 0, false
	}
	return time.Duration(n) * time.Second, true
}

// Wait waits out a retry-after: it returns nil once d has passed, ctx's
// error when ctx ends first, and context.DeadlineExceeded at once when
// ctx's deadline comes before d has passed. The broker's limits wait with
// it for a unit, and the clients for the broker's retry-after.
func Wait(ctx context.Context, d time.Duration) error {
	if deadline, ok := ctx.Deadline(); ok && time.Until(deadline) < d {
		return context.DeadlineExceeded
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
