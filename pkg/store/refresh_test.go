package store

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// An entry asked for near its end is refreshed in the background, once,
// while callers keep getting it from the cache.
func TestRefreshAhead(t *testing.T) {
	clk := newFakeClock()
	c, err := New[string, int](Config{Size: 10, MaxTTL: time.Hour, Clock: clk, RefreshWithin: 2 * time.Second,
		Refreshable: func(v any) bool { return v.(int) > 0 }})
	require.NoError(t, err)
	ctx := context.Background()
	fetches := make(chan context.Context, 10)
	release := make(chan struct{})
	next := 1
	fetch := func(ctx context.Context) (int, time.Time, error) {
		fetches <- ctx
		if Refreshing(ctx) {
			<-release
		}
		next++
		return next - 1, clk.Now().Add(10 * time.Second), nil
	}
	v, hit, err := c.Do(ctx, "k", fetch)
	require.NoError(t, err)
	assert.Equal(t, 1, v)
	assert.False(t, hit)
	assert.False(t, Refreshing(recv(t, fetches)), "a caller's fetch is no refresh")

	clk.Step(7 * time.Second) // 3s left: not yet
	v, hit, _ = c.Do(ctx, "k", fetch)
	assert.Equal(t, []any{1, true}, []any{v, hit})
	assert.Empty(t, fetches)

	clk.Step(time.Second) // 2s left: refresh, once
	for range 3 {
		v, hit, _ = c.Do(ctx, "k", fetch)
		assert.Equal(t, []any{1, true}, []any{v, hit}, "the entry serves while it is refreshed")
	}
	rctx := recv(t, fetches)
	assert.True(t, Refreshing(rctx))
	deadline, ok := rctx.Deadline()
	require.True(t, ok)
	assert.WithinDuration(t, time.Now().Add(2*time.Second), deadline, time.Second, "the refresh may wait until the entry's end")
	close(release)
	require.Eventually(t, func() bool { v, _ := c.Get("k"); return v == 2 }, 10*time.Second, time.Millisecond)
	assert.Empty(t, fetches, "one refresh per entry")

	// The new entry is refreshed in its turn.
	clk.Step(8 * time.Second)
	_, _, _ = c.Do(ctx, "k", fetch)
	assert.True(t, Refreshing(recv(t, fetches)))
}

func TestRefreshAheadFailureLeavesTheEntry(t *testing.T) {
	clk := newFakeClock()
	c, err := New[string, int](Config{Size: 10, MaxTTL: time.Hour, Clock: clk, RefreshWithin: 2 * time.Second})
	require.NoError(t, err)
	c.Add("k", 1, clk.Now().Add(time.Second))
	done := make(chan struct{})
	_, hit, err := c.Do(context.Background(), "k", func(context.Context) (int, time.Time, error) {
		defer close(done)
		return 0, time.Time{}, errors.New("no budget")
	})
	require.NoError(t, err)
	assert.True(t, hit)
	recv(t, done)
	v, ok := c.Get("k")
	assert.True(t, ok)
	assert.Equal(t, 1, v, "a failed refresh leaves the entry to serve until its end")
}

func TestRefreshAheadSkipsWhatIsNotRefreshable(t *testing.T) {
	clk := newFakeClock()
	c, err := New[string, int](Config{Size: 10, MaxTTL: time.Hour, Clock: clk, RefreshWithin: time.Hour,
		Refreshable: func(v any) bool { return v.(int) > 0 }})
	require.NoError(t, err)
	c.Add("denied", 0, clk.Now().Add(time.Second))
	_, hit, err := c.Do(context.Background(), "denied", func(context.Context) (int, time.Time, error) {
		t.Error("a value that is not refreshable is not refreshed")
		return 0, time.Time{}, nil
	})
	require.NoError(t, err)
	assert.True(t, hit)

	_, err = New[string, int](Config{Size: 1, MaxTTL: time.Hour, RefreshWithin: -1})
	assert.Error(t, err)
}

// Fresh answers only what Do would answer from the cache without doing
// anything else: a caller that skips Do on its word must never skip a
// refresh that is due.
func TestFreshLeavesDueRefreshesToDo(t *testing.T) {
	clk := newFakeClock()
	c, err := New[string, int](Config{Size: 10, MaxTTL: time.Hour, Clock: clk, RefreshWithin: 2 * time.Second,
		Refreshable: func(v any) bool { return v.(int) > 0 }})
	require.NoError(t, err)
	_, ok := c.Fresh("k")
	assert.False(t, ok, "a missing key")

	c.Add("k", 1, clk.Now().Add(10*time.Second))
	c.Add("not-refreshable", -1, clk.Now().Add(10*time.Second))
	v, ok := c.Fresh("k")
	assert.Equal(t, []any{1, true}, []any{v, ok}, "8s of 10s left")

	clk.Step(8 * time.Second) // 2s left: a refresh is due
	_, ok = c.Fresh("k")
	assert.False(t, ok, "Fresh answered an entry whose refresh is due, so no refresh would start")
	v, ok = c.Fresh("not-refreshable")
	assert.Equal(t, []any{-1, true}, []any{v, ok}, "an entry that is never refreshed")

	release := make(chan struct{})
	defer close(release)
	_, _, err = c.Do(context.Background(), "k", func(context.Context) (int, time.Time, error) {
		<-release
		return 2, clk.Now().Add(10 * time.Second), nil
	})
	require.NoError(t, err)
	v, ok = c.Fresh("k")
	assert.Equal(t, []any{1, true}, []any{v, ok}, "its refresh has started")

	clk.Step(2 * time.Second)
	_, ok = c.Fresh("k")
	assert.False(t, ok, "a stale entry")
}
