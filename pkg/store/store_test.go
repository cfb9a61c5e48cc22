package store

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fakeClock is a Clock that moves only when told to.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{now: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
}

func (f *fakeClock) Now() time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.now
}

func (f *fakeClock) Step(d time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.now = f.now.Add(d)
}

// newCache returns a cache whose MaxTTL is far longer than any test, so only
// the fake clock decides freshness.
func newCache[V any](t *testing.T, size int) (*Cache[string, V], *fakeClock) {
	t.Helper()
	clk := newFakeClock()
	c, err := New[string, V](Config{Size: size, MaxTTL: time.Hour, Clock: clk})
	require.NoError(t, err)
	return c, clk
}

// recv waits for a value from ch. The deadline only stops a broken test from
// hanging; nothing here asserts on timing.
func recv[T any](t *testing.T, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(30 * time.Second):
		t.Fatal("test hung waiting on a channel")
		panic("unreachable")
	}
}

type result struct {
	v   string
	hit bool
	err error
}

func TestNew(t *testing.T) {
	tests := []struct {
		name    string
		cfg     Config
		wantErr string
	}{
		{name: "ok", cfg: Config{Size: 1, MaxTTL: time.Minute}},
		{name: "smallest MaxTTL", cfg: Config{Size: 1, MaxTTL: 100 * time.Nanosecond}},
		{name: "zero size", cfg: Config{MaxTTL: time.Minute}, wantErr: "store: Config.Size must be > 0, got 0"},
		{name: "negative size", cfg: Config{Size: -1, MaxTTL: time.Minute}, wantErr: "store: Config.Size must be > 0, got -1"},
		{name: "zero MaxTTL", cfg: Config{Size: 1}, wantErr: "store: Config.MaxTTL must be at least 100ns, got 0s"},
		{name: "tiny MaxTTL", cfg: Config{Size: 1, MaxTTL: 99}, wantErr: "store: Config.MaxTTL must be at least 100ns, got 99ns"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := New[string, int](tt.cfg)
			if tt.wantErr != "" {
				require.EqualError(t, err, tt.wantErr)
				assert.Nil(t, c)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, 0, c.Len())
		})
	}
}

func TestNewDefaultsToRealClock(t *testing.T) {
	c, err := New[string, string](Config{Size: 1, MaxTTL: time.Hour})
	require.NoError(t, err)
	c.Add("k", "v", time.Now().Add(time.Hour))
	v, ok := c.Get("k")
	require.True(t, ok)
	assert.Equal(t, "v", v)
}

func TestFreshnessPerEntry(t *testing.T) {
	c, clk := newCache[string](t, 10)
	start := clk.Now()
	c.Add("short", "s", start.Add(time.Minute))
	c.Add("long", "l", start.Add(5*time.Minute))
	require.Equal(t, 2, c.Len())

	steps := []struct {
		name      string
		to        time.Duration // since start
		wantShort bool
		wantLong  bool
		wantLen   int
	}{
		{name: "both fresh", to: 0, wantShort: true, wantLong: true, wantLen: 2},
		{name: "just before short", to: time.Minute - time.Nanosecond, wantShort: true, wantLong: true, wantLen: 2},
		{name: "short ends exactly now", to: time.Minute, wantShort: false, wantLong: true, wantLen: 1},
		{name: "long still fresh", to: 4 * time.Minute, wantShort: false, wantLong: true, wantLen: 1},
		{name: "both stale", to: 5 * time.Minute, wantShort: false, wantLong: false, wantLen: 0},
	}
	for _, s := range steps {
		t.Run(s.name, func(t *testing.T) {
			clk.Step(start.Add(s.to).Sub(clk.Now()))
			v, ok := c.Get("short")
			assert.Equal(t, s.wantShort, ok)
			if ok {
				assert.Equal(t, "s", v)
			} else {
				assert.Empty(t, v)
			}
			v, ok = c.Get("long")
			assert.Equal(t, s.wantLong, ok)
			if ok {
				assert.Equal(t, "l", v)
			}
			// A stale entry is removed when Get sees it.
			assert.Equal(t, s.wantLen, c.Len())
		})
	}
}

func TestAddNotFresh(t *testing.T) {
	tests := []struct {
		name       string
		freshUntil time.Duration // from now
		wantOK     bool
	}{
		{name: "in the past", freshUntil: -time.Second},
		{name: "exactly now", freshUntil: 0},
		{name: "one nanosecond ahead", freshUntil: time.Nanosecond, wantOK: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, clk := newCache[string](t, 10)
			c.Add("k", "v", clk.Now().Add(tt.freshUntil))
			_, ok := c.Get("k")
			assert.Equal(t, tt.wantOK, ok)
		})
	}

	t.Run("stale Add leaves an existing entry alone", func(t *testing.T) {
		c, clk := newCache[string](t, 10)
		c.Add("k", "old", clk.Now().Add(time.Minute))
		c.Add("k", "new", clk.Now().Add(-time.Minute))
		v, ok := c.Get("k")
		require.True(t, ok)
		assert.Equal(t, "old", v)
	})
}

func TestAddReplaces(t *testing.T) {
	c, clk := newCache[string](t, 10)
	c.Add("k", "a", clk.Now().Add(time.Minute))
	c.Add("k", "b", clk.Now().Add(3*time.Minute))
	clk.Step(2 * time.Minute)
	v, ok := c.Get("k")
	require.True(t, ok)
	assert.Equal(t, "b", v)
	assert.Equal(t, 1, c.Len())
}

func TestRemove(t *testing.T) {
	c, clk := newCache[string](t, 10)
	c.Add("k", "v", clk.Now().Add(time.Minute))
	c.Remove("k")
	c.Remove("absent")
	_, ok := c.Get("k")
	assert.False(t, ok)
	assert.Equal(t, 0, c.Len())
}

func TestLRUEviction(t *testing.T) {
	tests := []struct {
		name    string
		ops     []string // "add:k" or "get:k"
		present []string
		absent  []string
	}{
		{
			name:    "oldest goes",
			ops:     []string{"add:a", "add:b", "add:c"},
			present: []string{"b", "c"},
			absent:  []string{"a"},
		},
		{
			name:    "get makes recent",
			ops:     []string{"add:a", "add:b", "get:a", "add:c"},
			present: []string{"a", "c"},
			absent:  []string{"b"},
		},
		{
			name:    "re-add makes recent",
			ops:     []string{"add:a", "add:b", "add:a", "add:c"},
			present: []string{"a", "c"},
			absent:  []string{"b"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, clk := newCache[string](t, 2)
			for _, op := range tt.ops {
				switch op[:4] {
				case "add:":
					c.Add(op[4:], op[4:], clk.Now().Add(time.Minute))
				case "get:":
					_, ok := c.Get(op[4:])
					require.True(t, ok, op)
				}
			}
			assert.Equal(t, 2, c.Len())
			for _, k := range tt.present {
				v, ok := c.Get(k)
				assert.True(t, ok, k)
				assert.Equal(t, k, v)
			}
			for _, k := range tt.absent {
				_, ok := c.Get(k)
				assert.False(t, ok, k)
			}
		})
	}
}

func TestDoCachesAndHits(t *testing.T) {
	c, clk := newCache[string](t, 10)
	calls := 0
	fetch := func(context.Context) (string, time.Time, error) {
		calls++
		return "v" + strconv.Itoa(calls), clk.Now().Add(time.Minute), nil
	}

	v, hit, err := c.Do(t.Context(), "k", fetch)
	require.NoError(t, err)
	assert.Equal(t, "v1", v)
	assert.False(t, hit)

	v, hit, err = c.Do(t.Context(), "k", fetch)
	require.NoError(t, err)
	assert.Equal(t, "v1", v)
	assert.True(t, hit)
	assert.Equal(t, 1, calls)

	got, ok := c.Get("k")
	require.True(t, ok)
	assert.Equal(t, "v1", got)

	// Once stale, Do fetches again.
	clk.Step(time.Minute)
	v, hit, err = c.Do(t.Context(), "k", fetch)
	require.NoError(t, err)
	assert.Equal(t, "v2", v)
	assert.False(t, hit)
	assert.Equal(t, 2, calls)
}

func TestDoNotFreshResultIsReturnedButNotCached(t *testing.T) {
	c, clk := newCache[string](t, 10)
	calls := 0
	fetch := func(context.Context) (string, time.Time, error) {
		calls++
		return "v", clk.Now(), nil
	}
	for range 2 {
		v, hit, err := c.Do(t.Context(), "k", fetch)
		require.NoError(t, err)
		assert.Equal(t, "v", v)
		assert.False(t, hit)
	}
	assert.Equal(t, 2, calls)
	assert.Equal(t, 0, c.Len())
}

func TestDoConcurrentCallersFetchOnce(t *testing.T) {
	const callers = 50
	c, clk := newCache[string](t, 10)

	var joined sync.WaitGroup
	joined.Add(callers)
	c.testHookJoined = func(string) { joined.Done() }

	release := make(chan struct{})
	var calls atomic.Int32
	fetch := func(context.Context) (string, time.Time, error) {
		calls.Add(1)
		<-release
		return "v", clk.Now().Add(time.Minute), nil
	}

	results := make(chan result, callers)
	for range callers {
		go func() {
			v, hit, err := c.Do(t.Context(), "k", fetch)
			results <- result{v, hit, err}
		}()
	}
	// Every caller has joined the one fetch before it may finish.
	joined.Wait()
	close(release)

	for range callers {
		r := recv(t, results)
		require.NoError(t, r.err)
		assert.Equal(t, "v", r.v)
		assert.False(t, r.hit, "all callers shared the fetch, none hit the cache")
	}
	assert.Equal(t, int32(1), calls.Load())
}

func TestDoDifferentKeysFetchSeparately(t *testing.T) {
	c, clk := newCache[string](t, 10)
	for _, k := range []string{"a", "b"} {
		v, _, err := c.Do(t.Context(), k, func(context.Context) (string, time.Time, error) {
			return "v-" + k, clk.Now().Add(time.Minute), nil
		})
		require.NoError(t, err)
		assert.Equal(t, "v-"+k, v)
	}
	assert.Equal(t, 2, c.Len())
}

// Keys of 32 bytes (hashes) share one flight per key, as strings do, and
// only per key.
func TestDoHashKeys(t *testing.T) {
	clk := newFakeClock()
	c, err := New[[32]byte, int](Config{Size: 10, MaxTTL: time.Hour, Clock: clk})
	require.NoError(t, err)
	a, b := [32]byte{1}, [32]byte{2}
	release := make(chan struct{})
	var fetches atomic.Int32
	fetch := func(context.Context) (int, time.Time, error) {
		fetches.Add(1)
		<-release
		return 1, clk.Now().Add(time.Minute), nil
	}
	var wg sync.WaitGroup
	for _, k := range [][32]byte{a, a, a, b} {
		wg.Go(func() {
			_, _, err := c.Do(t.Context(), k, fetch)
			assert.NoError(t, err)
		})
	}
	require.Eventually(t, func() bool { return fetches.Load() == 2 }, 5*time.Second, time.Millisecond)
	close(release)
	wg.Wait()
	assert.Equal(t, int32(2), fetches.Load(), "one fetch per key")
	assert.Equal(t, 2, c.Len())
}

func TestDoErrorsNotCached(t *testing.T) {
	c, clk := newCache[string](t, 10)
	errBoom := errors.New("boom")
	calls := 0
	fetch := func(context.Context) (string, time.Time, error) {
		calls++
		if calls == 1 {
			return "ignored", clk.Now().Add(time.Minute), errBoom
		}
		return "v", clk.Now().Add(time.Minute), nil
	}

	v, hit, err := c.Do(t.Context(), "k", fetch)
	require.ErrorIs(t, err, errBoom)
	assert.Empty(t, v)
	assert.False(t, hit)
	assert.Equal(t, 0, c.Len())

	v, hit, err = c.Do(t.Context(), "k", fetch)
	require.NoError(t, err)
	assert.Equal(t, "v", v)
	assert.False(t, hit)
	assert.Equal(t, 2, calls)
}

func TestDoCancelledCallerReturnsWhileFetchCompletes(t *testing.T) {
	c, clk := newCache[string](t, 10)

	var joined sync.WaitGroup
	joined.Add(2)
	c.testHookJoined = func(string) { joined.Done() }

	started := make(chan struct{})
	release := make(chan struct{})
	fetchCtxErr := make(chan error, 1)
	fetch := func(ctx context.Context) (string, time.Time, error) {
		close(started)
		<-release
		fetchCtxErr <- ctx.Err()
		return "v", clk.Now().Add(time.Minute), nil
	}

	// The impatient caller starts the fetch, so fetch runs under its ctx.
	impatientCtx, cancel := context.WithCancel(t.Context())
	impatient := make(chan result, 1)
	go func() {
		v, hit, err := c.Do(impatientCtx, "k", fetch)
		impatient <- result{v, hit, err}
	}()
	recv(t, started)

	patient := make(chan result, 1)
	go func() {
		v, hit, err := c.Do(t.Context(), "k", fetch)
		patient <- result{v, hit, err}
	}()
	joined.Wait()

	// The impatient caller returns while fetch is still blocked.
	cancel()
	r := recv(t, impatient)
	require.ErrorIs(t, r.err, context.Canceled)
	assert.Empty(t, r.v)
	assert.False(t, r.hit)
	select {
	case <-patient:
		t.Fatal("patient caller returned before fetch finished")
	default:
	}

	close(release)
	require.NoError(t, recv(t, fetchCtxErr), "fetch's ctx must not be cancelled with the first caller's")
	r = recv(t, patient)
	require.NoError(t, r.err)
	assert.Equal(t, "v", r.v)
	assert.False(t, r.hit)

	v, ok := c.Get("k")
	require.True(t, ok)
	assert.Equal(t, "v", v)
}

func TestDoContextAlreadyDone(t *testing.T) {
	c, clk := newCache[string](t, 10)
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	called := false
	fetch := func(context.Context) (string, time.Time, error) {
		called = true
		return "v", clk.Now().Add(time.Minute), nil
	}

	_, _, err := c.Do(ctx, "k", fetch)
	require.ErrorIs(t, err, context.Canceled)
	assert.False(t, called)

	// A fresh entry is still served to a caller whose ctx is done.
	c.Add("k", "cached", clk.Now().Add(time.Minute))
	v, hit, err := c.Do(ctx, "k", fetch)
	require.NoError(t, err)
	assert.Equal(t, "cached", v)
	assert.True(t, hit)
}

func TestDoPanicBecomesError(t *testing.T) {
	const secret = "s3cr3t-token"
	c, clk := newCache[string](t, 10)

	var joined sync.WaitGroup
	joined.Add(2)
	c.testHookJoined = func(string) { joined.Done() }

	release := make(chan struct{})
	fetch := func(context.Context) (string, time.Time, error) {
		<-release
		panic(fmt.Errorf("bad token %s", secret))
	}

	results := make(chan result, 2)
	for range 2 {
		go func() {
			v, hit, err := c.Do(t.Context(), "k", fetch)
			results <- result{v, hit, err}
		}()
	}
	joined.Wait()
	close(release)

	for range 2 {
		r := recv(t, results)
		require.ErrorIs(t, r.err, ErrFetchPanicked)
		assert.NotContains(t, r.err.Error(), secret)
		assert.Empty(t, r.v)
		assert.False(t, r.hit)
	}
	assert.Equal(t, 0, c.Len())

	// The panic is not cached either.
	c.testHookJoined = nil
	v, _, err := c.Do(t.Context(), "k", func(context.Context) (string, time.Time, error) {
		return "v", clk.Now().Add(time.Minute), nil
	})
	require.NoError(t, err)
	assert.Equal(t, "v", v)
}

func TestDoPanicNil(t *testing.T) {
	c, _ := newCache[string](t, 10)
	_, _, err := c.Do(t.Context(), "k", func(context.Context) (string, time.Time, error) {
		panic(nil)
	})
	require.ErrorIs(t, err, ErrFetchPanicked)
}

func TestHalfway(t *testing.T) {
	base := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	tests := []struct {
		name    string
		issued  time.Time
		expires time.Time
		want    time.Time
	}{
		{name: "one hour", issued: base, expires: base.Add(time.Hour), want: base.Add(30 * time.Minute)},
		{name: "ten minutes", issued: base, expires: base.Add(10 * time.Minute), want: base.Add(5 * time.Minute)},
		{name: "odd nanoseconds round down", issued: base, expires: base.Add(3), want: base.Add(1)},
		{name: "one nanosecond", issued: base, expires: base.Add(1), want: base},
		{name: "empty", issued: base, expires: base, want: base},
		{name: "expires before issued", issued: base, expires: base.Add(-time.Hour), want: base.Add(-time.Hour)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Halfway(tt.issued, tt.expires)
			assert.True(t, tt.want.Equal(got), "Halfway(%v, %v) = %v, want %v", tt.issued, tt.expires, got, tt.want)
		})
	}
}

// Halfway is the midpoint even when the span does not fit in a Duration,
// such as a token with no issue time.
func TestHalfwayMidpoint(t *testing.T) {
	nanos := func(t time.Time) *big.Int {
		n := big.NewInt(t.Unix())
		n.Mul(n, big.NewInt(1e9))
		return n.Add(n, big.NewInt(int64(t.Nanosecond())))
	}
	base := time.Date(2026, 5, 6, 7, 8, 9, 10, time.UTC)
	tests := []struct {
		name            string
		issued, expires time.Time
	}{
		{name: "one second", issued: base, expires: base.Add(time.Second)},
		{name: "a century", issued: base, expires: base.Add(100 * 365 * 24 * time.Hour)},
		{name: "zero issued", issued: time.Time{}, expires: base},
		{name: "four centuries, odd nanoseconds", issued: time.Date(1700, 1, 1, 0, 0, 0, 999_999_999, time.UTC), expires: time.Date(2100, 1, 1, 0, 0, 1, 4, time.UTC)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := Halfway(tt.issued, tt.expires)
			require.True(t, h.After(tt.issued) && h.Before(tt.expires), "Halfway = %v", h)
			// 2h = issued + expires, to within the nanosecond lost by rounding down.
			diff := new(big.Int).Mul(nanos(h), big.NewInt(2))
			diff.Sub(diff, nanos(tt.issued))
			diff.Sub(diff, nanos(tt.expires))
			assert.True(t, diff.CmpAbs(big.NewInt(1)) <= 0, "2*Halfway - issued - expires = %v ns", diff)
		})
	}
}
