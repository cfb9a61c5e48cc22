package errdefs

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
)

func TestRetryAfter(t *testing.T) {
	err := fmt.Errorf("wrapped: %w", WithRetryAfter(fmt.Errorf("too many: %w", ErrResourceExhausted), 1500*time.Millisecond))
	wait, ok := RetryAfter(err)
	assert.True(t, ok)
	assert.Equal(t, 1500*time.Millisecond, wait)
	assert.Equal(t, codes.ResourceExhausted, Code(err), "the mark keeps the code")
	assert.Equal(t, "wrapped: too many: resource exhausted", err.Error())
	_, ok = RetryAfter(ErrResourceExhausted)
	assert.False(t, ok)
}

func TestRetryAfterTrailer(t *testing.T) {
	tests := []struct {
		wait time.Duration
		want string
	}{
		{time.Millisecond, "1"},
		{time.Second, "1"},
		{1001 * time.Millisecond, "2"},
		{0, "1"},
	}
	for _, tt := range tests {
		md := RetryAfterTrailer(tt.wait)
		assert.Equal(t, []string{tt.want}, md.Get(RetryAfterKey), tt.wait)
		got, ok := ParseRetryAfter(md)
		assert.True(t, ok)
		assert.Equal(t, RetryAfterSeconds(tt.wait), int64(got/time.Second))
	}
}

func TestParseRetryAfterRefusesJunk(t *testing.T) {
	for _, v := range [][]string{nil, {"0"}, {"-1"}, {"1.5"}, {"soon"}, {"1", "2"}, {"99999999"}} {
		_, ok := ParseRetryAfter(metadata.MD{RetryAfterKey: v})
		assert.False(t, ok, v)
	}
}

func FuzzParseRetryAfter(f *testing.F) {
	for _, s := range []string{"1", "0", "-3", "abc", "86400", "86401"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if d, ok := ParseRetryAfter(metadata.Pairs(RetryAfterKey, s)); ok && (d <= 0 || d > 24*time.Hour) {
			t.Fatalf("ParseRetryAfter(%q) = %s", s, d)
		}
	})
}

// deadlineOnly has a deadline but never ends by itself, so only Wait's
// look at the deadline can end a wait that outlasts it.
type deadlineOnly struct {
	context.Context
	deadline time.Time
}

func (c deadlineOnly) Deadline() (time.Time, bool) { return c.deadline, true }

// Wait returns once the wait has passed, when the context ends, and at
// once when the context's deadline comes first.
func TestWait(t *testing.T) {
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	tests := []struct {
		name string
		ctx  context.Context
		wait time.Duration
		want error
	}{
		{name: "the wait passes", ctx: context.Background(), wait: time.Millisecond},
		{name: "the context has ended", ctx: canceled, wait: time.Hour, want: context.Canceled},
		{name: "the deadline comes first", ctx: deadlineOnly{context.Background(), time.Now().Add(time.Minute)},
			wait: time.Hour, want: context.DeadlineExceeded},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			done := make(chan error, 1)
			go func() { done <- Wait(tt.ctx, tt.wait) }()
			select {
			case err := <-done:
				assert.Equal(t, tt.want, err)
			case <-time.After(10 * time.Second):
				t.Fatal("Wait did not return")
			}
		})
	}
}
