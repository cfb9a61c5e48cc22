package store

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/hashicorp/golang-lru/v2/expirable"
	"golang.org/x/sync/singleflight"
)

// Clock tells the time. k8s.io/utils/clock clocks satisfy it.
type Clock interface {
	Now() time.Time
}

type realClock struct{}

func (realClock) Now() time.Time { return time.Now() }

// minMaxTTL is the smallest MaxTTL the expirable LRU accepts: its cleaner
// ticks every MaxTTL/100 and a zero tick panics.
const minMaxTTL = 100 * time.Nanosecond

// Config configures a Cache.
type Config struct {
	// Size is the maximum number of entries; the least recently used entry
	// is evicted beyond it. Required, > 0.
	Size int
	// MaxTTL bounds how long, by the real clock, any entry is kept in memory
	// after it was last stored, whatever its freshness. Required, at least
	// 100ns.
	MaxTTL time.Duration
	// Clock decides freshness. Default: the real clock.
	Clock Clock
	// RefreshWithin, when positive, makes Do refresh an entry ahead of
	// time: a Do that finds an entry with no more than RefreshWithin of
	// freshness left returns it, and starts its fetch again in the
	// background, once per stored entry, under a context for which
	// Refreshing reports true and whose deadline is the entry's end. The
	// result replaces the entry; an error leaves it to serve until its end.
	// So a key that is asked for all the time is never missed.
	RefreshWithin time.Duration
	// Refreshable, when set, picks the values worth refreshing ahead of
	// time, such as approvals but not denials. Default: every value.
	Refreshable func(v any) bool
}

// refreshingKey marks the context of a refresh ahead of time.
type refreshingKey struct{}

// Refreshing reports whether ctx is that of a fetch that refreshes a
// fresh entry ahead of time (Config.RefreshWithin), rather than one that a
// caller waits for. Such a fetch may wait for budget that a caller could
// not, until ctx's deadline.
func Refreshing(ctx context.Context) bool { return ctx.Value(refreshingKey{}) != nil }

// ErrFetchPanicked is wrapped by the error Do returns when fetch panicked.
var ErrFetchPanicked = errors.New("store: fetch panicked")

type entry[V any] struct {
	v          V
	freshUntil time.Time
	// refreshing is set once a refresh ahead of time has started.
	refreshing bool
}

// Key is what a Cache is keyed by: a string, or the 32 bytes of a hash
// (such as a SHA-256), which cost no allocation to make.
type Key interface {
	string | [32]byte
}

// flightKey is key as the string that singleflight groups calls by.
func flightKey[K Key](key K) string {
	switch k := any(key).(type) {
	case [32]byte:
		return string(k[:])
	default:
		return any(key).(string)
	}
}

// Cache is a bounded cache whose entries are each fresh until their own
// time. It is safe for concurrent use.
type Cache[K Key, V any] struct {
	clock Clock
	lru   *expirable.LRU[K, entry[V]]
	group singleflight.Group
	// refreshWithin and refreshable are Config's.
	refreshWithin time.Duration
	refreshable   func(any) bool

	// mu makes Get's check-then-remove and Add atomic with respect to each
	// other, so Get never removes a fresh entry that Add just stored.
	mu sync.Mutex

	// testHookJoined, when set, is called by Do after the caller has joined
	// (or started) the fetch for key and before it waits.
	testHookJoined func(key K)
}

// New returns an empty Cache.
func New[K Key, V any](cfg Config) (*Cache[K, V], error) {
	if cfg.Size <= 0 {
		return nil, fmt.Errorf("store: Config.Size must be > 0, got %d", cfg.Size)
	}
	if cfg.MaxTTL < minMaxTTL {
		return nil, fmt.Errorf("store: Config.MaxTTL must be at least %v, got %v", minMaxTTL, cfg.MaxTTL)
	}
	clk := cfg.Clock
	if clk == nil {
		clk = realClock{}
	}
	if cfg.RefreshWithin < 0 {
		return nil, fmt.Errorf("store: Config.RefreshWithin must not be negative, got %v", cfg.RefreshWithin)
	}
	return &Cache[K, V]{
		clock:         clk,
		lru:           expirable.NewLRU[K, entry[V]](cfg.Size, nil, cfg.MaxTTL),
		refreshWithin: cfg.RefreshWithin,
		refreshable:   cfg.Refreshable,
	}, nil
}

// Get returns the value stored for key if Clock.Now() is before its
// freshUntil. A stale entry is removed and reported missing.
func (c *Cache[K, V]) Get(key K) (V, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.lru.Get(key)
	if !ok {
		var zero V
		return zero, false
	}
	if !c.clock.Now().Before(e.freshUntil) {
		c.lru.Remove(key)
		var zero V
		return zero, false
	}
	return e.v, true
}

// Fresh returns the value stored for key when Do would return it and do
// nothing else: it is fresh, and no refresh of it is due
// (Config.RefreshWithin). A caller that gets false calls Do; one that gets
// true need not build Do's fetch, which on a hot path is an allocation.
func (c *Cache[K, V]) Fresh(key K) (V, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.lru.Get(key)
	if !ok || !c.clock.Now().Before(e.freshUntil) || c.due(e) {
		var zero V
		return zero, false
	}
	return e.v, true
}

// due reports whether e is due for a refresh ahead of its end. c.mu is
// held.
func (c *Cache[K, V]) due(e entry[V]) bool {
	return c.refreshWithin > 0 && !e.refreshing && e.freshUntil.Sub(c.clock.Now()) <= c.refreshWithin &&
		(c.refreshable == nil || c.refreshable(e.v))
}

// Add stores v for key, fresh until freshUntil, replacing any entry for key.
// It does nothing when freshUntil is not after Clock.Now().
func (c *Cache[K, V]) Add(key K, v V, freshUntil time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !freshUntil.After(c.clock.Now()) {
		return
	}
	c.lru.Add(key, entry[V]{v: v, freshUntil: freshUntil})
}

// Remove removes the entry for key, if any.
func (c *Cache[K, V]) Remove(key K) {
	c.lru.Remove(key)
}

// Len returns the number of entries held in memory, including stale entries
// that no Get has looked at yet.
func (c *Cache[K, V]) Len() int {
	return c.lru.Len()
}

type flight[V any] struct {
	v   V
	hit bool
}

// Do returns the fresh cached value for key (hit=true), or calls fetch once
// for all concurrent callers of the same key, caches its result until the
// freshUntil it returns, and returns it (hit=false). A result whose
// freshUntil is not after now is returned but not cached.
//
// fetch runs under context.WithoutCancel(ctx) of the caller that started it,
// so one caller giving up does not fail the others; fetch must bound itself.
// Each caller waits with its own ctx and returns an error wrapping ctx.Err()
// if that ends first. Errors from fetch are returned as they are and not
// cached. A panic in fetch is returned to every waiter as an error wrapping
// ErrFetchPanicked.
func (c *Cache[K, V]) Do(ctx context.Context, key K, fetch func(ctx context.Context) (V, time.Time, error)) (v V, hit bool, err error) {
	if v, ok := c.Get(key); ok {
		c.refreshAhead(ctx, key, fetch)
		return v, true, nil
	}
	if err := ctx.Err(); err != nil {
		return v, false, fmt.Errorf("store: not waiting for fetch: %w", err)
	}
	fetchCtx := context.WithoutCancel(ctx)
	ch := c.group.DoChan(flightKey(key), func() (any, error) {
		// A fetch for key may have finished between our Get and DoChan.
		if v, ok := c.Get(key); ok {
			return flight[V]{v: v, hit: true}, nil
		}
		v, freshUntil, err := safeFetch(fetchCtx, fetch)
		if err != nil {
			return nil, err
		}
		c.Add(key, v, freshUntil)
		return flight[V]{v: v}, nil
	})
	if c.testHookJoined != nil {
		c.testHookJoined(key)
	}
	select {
	case <-ctx.Done():
		return v, false, fmt.Errorf("store: waiting for fetch: %w", ctx.Err())
	case res := <-ch:
		if res.Err != nil {
			return v, false, res.Err
		}
		f := res.Val.(flight[V])
		return f.v, f.hit, nil
	}
}

// refreshAhead starts the background refresh of key's entry when it is
// due (Config.RefreshWithin), once per stored entry.
func (c *Cache[K, V]) refreshAhead(ctx context.Context, key K, fetch func(ctx context.Context) (V, time.Time, error)) {
	if c.refreshWithin <= 0 {
		return
	}
	c.mu.Lock()
	e, ok := c.lru.Peek(key)
	due := ok && c.due(e)
	if due {
		e.refreshing = true
		c.lru.Add(key, e)
	}
	c.mu.Unlock()
	if !due {
		return
	}
	// The refresh's deadline is the entry's end by the cache's clock,
	// counted on the real clock that contexts use.
	rctx, cancel := context.WithTimeout(context.WithValue(context.WithoutCancel(ctx), refreshingKey{}, true),
		e.freshUntil.Sub(c.clock.Now()))
	// Its own flight: a caller that misses meanwhile fetches on its own
	// terms rather than wait on a refresh that may wait for budget.
	go func() {
		defer cancel()
		_, _, _ = c.group.Do("\x00refresh\x00"+flightKey(key), func() (any, error) {
			v, freshUntil, err := safeFetch(rctx, fetch)
			if err == nil {
				c.Add(key, v, freshUntil)
			}
			return nil, err
		})
	}()
}

// safeFetch calls fetch and turns a panic into an error. The panic value is
// dropped, since it may contain secrets; only its type is kept. singleflight
// must never see the panic: with DoChan it would re-panic in a new goroutine
// and crash the process.
func safeFetch[V any](ctx context.Context, fetch func(context.Context) (V, time.Time, error)) (v V, freshUntil time.Time, err error) {
	defer func() {
		if r := recover(); r != nil {
			var zero V
			v, freshUntil, err = zero, time.Time{}, fmt.Errorf("%w (%T)", ErrFetchPanicked, r)
		}
	}()
	return fetch(ctx)
}

// Halfway returns the instant when half of [issued, expires) has passed.
// Tokens are reused only while at least half their lifetime remains, so
// Halfway(issued, expires) is the freshUntil to cache a token with. When
// expires is not after issued, it returns expires.
func Halfway(issued, expires time.Time) time.Time {
	d := expires.Sub(issued)
	if d <= 0 {
		return expires
	}
	if d < math.MaxInt64 {
		return issued.Add(d / 2)
	}
	// The span does not fit in a Duration (such as a zero issued time):
	// halve it in seconds and nanoseconds instead.
	s := expires.Unix() - issued.Unix()
	ns := int64(expires.Nanosecond()) - int64(issued.Nanosecond())
	half := time.Duration(s%2)*time.Second/2 + time.Duration(ns/2)
	return time.Unix(issued.Unix()+s/2, int64(issued.Nanosecond())).Add(half).In(issued.Location())
}
