package tunnel

import (
	"math/rand/v2"
	"time"
)

// jitter returns a wait between half of d and d, both included, so that
// agents that lost their broker together do not all come back together.
func jitter(d time.Duration) time.Duration { return d/2 + rand.N(d/2+1) }

// backoff is the wait between reconnects: it starts at initial and doubles
// up to max, each wait jittered (jitter); for max after a broker said it
// drains, it stays at initial, so that the agent finds the replica's
// replacement as soon as it listens.
type backoff struct {
	initial, max time.Duration
	cur          time.Duration // the next wait before jitter; initial when zero
	shortUntil   time.Time
}

func (b *backoff) reset() { b.cur = b.initial }

// stayShort keeps the waits at initial for max from now.
func (b *backoff) stayShort(now time.Time) {
	b.cur, b.shortUntil = b.initial, now.Add(b.max)
}

// next returns the wait before the next reconnect, and doubles the one
// after it unless the waits stay short.
func (b *backoff) next(now time.Time) time.Duration {
	if b.cur <= 0 {
		b.cur = b.initial
	}
	wait := jitter(b.cur)
	if !now.Before(b.shortUntil) {
		b.cur = min(2*b.cur, b.max)
	}
	return wait
}
