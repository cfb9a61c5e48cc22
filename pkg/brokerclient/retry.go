package brokerclient

import (
	"context"
	"math/rand/v2"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/credbroker/credbroker/pkg/errdefs"
)

// RetryAfter returns the wait that the broker asks for when it refused a
// call with err and trailer because of a rate limit: the "retry-after"
// trailer (errdefs.RetryAfterKey) of a ResourceExhausted refusal. It
// reports false for any other error, and for a refusal whose trailer holds
// no wait: such a refusal is final.
func RetryAfter(err error, trailer metadata.MD) (time.Duration, bool) {
	if status.Code(err) != codes.ResourceExhausted {
		return 0, false
	}
	return errdefs.ParseRetryAfter(trailer)
}

// WaitAndRetry calls call until it returns a result, or an error without a
// wait, and returns that. call returns, with an error, the wait the broker
// asked for (RetryAfter), or zero when the error is final.
//
// After a refusal with a wait, WaitAndRetry sleeps as told plus up to a
// fifth more, so that callers refused together do not all come back at
// once, and calls again, while the waits in all fit in maxWait and the
// next wait ends before ctx's deadline. Otherwise, and when ctx ends
// during a wait, it returns the refusal, not ctx's error: the caller
// learns why it got nothing. A maxWait of zero or less never waits.
//
// sleep waits for d or until ctx ends, when it returns ctx's error; nil
// means errdefs.Wait. Tests pass one that records the waits and returns at once.
func WaitAndRetry[T any](ctx context.Context, maxWait time.Duration, sleep func(context.Context, time.Duration) error, call func() (T, time.Duration, error)) (T, error) {
	if sleep == nil {
		sleep = errdefs.Wait
	}
	var waited time.Duration
	for {
		v, wait, err := call()
		if err == nil || wait <= 0 {
			return v, err
		}
		wait += rand.N(wait/5 + 1)
		if waited+wait > maxWait {
			return v, err
		}
		if deadline, ok := ctx.Deadline(); ok && time.Until(deadline) < wait {
			return v, err
		}
		if sleep(ctx, wait) != nil {
			return v, err
		}
		waited += wait
	}
}
