package tokenexchange

import (
	"context"
	"fmt"
	"time"

	"golang.org/x/time/rate"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/store"
)

// refreshShare is the part of a decision's lifetime, at its end, in which
// a call that uses it refreshes it in the background: the last quarter.
const refreshShare = 4

// spend takes one unit of lim at now. When none is left, a call gets an
// error wrapping errdefs.ErrResourceExhausted that carries the wait
// (errdefs.RetryAfter), and spends nothing: refusal describes the limit in
// words, and the error adds "retry after Ns". A refresh ahead of time
// (store.Refreshing) instead waits for its unit, until its context's
// deadline, the end of the decision it refreshes: a known consumer's
// refresh is paced by the limit, never refused by it.
func spend(ctx context.Context, lim *rate.Limiter, now time.Time, refusal string) error {
	r := lim.ReserveN(now, 1)
	if !r.OK() {
		// Only a burst below 1 refuses every reservation.
		return fmt.Errorf("%s: %w", refusal, errdefs.ErrResourceExhausted)
	}
	wait := r.DelayFrom(now)
	if wait <= 0 {
		return nil
	}
	if store.Refreshing(ctx) && errdefs.Wait(ctx, wait) == nil {
		return nil
	}
	r.CancelAt(now)
	return errdefs.WithRetryAfter(fmt.Errorf("%s; retry after %ds: %w", refusal, errdefs.RetryAfterSeconds(wait), errdefs.ErrResourceExhausted), wait)
}

// limiterFor returns the limiter that limiters holds for key, made with
// limit and burst on first use.
func limiterFor[K store.Key](ctx context.Context, limiters *store.Cache[K, *rate.Limiter], key K, limit rate.Limit, burst int, now time.Time) (*rate.Limiter, error) {
	lim, _, err := limiters.Do(ctx, key, func(context.Context) (*rate.Limiter, time.Time, error) {
		return rate.NewLimiter(limit, burst), now.Add(time.Hour), nil
	})
	return lim, err
}
