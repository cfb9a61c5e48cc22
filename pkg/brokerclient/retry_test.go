package brokerclient_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/credbroker/credbroker/pkg/brokerclient"
)

func TestRetryAfter(t *testing.T) {
	exhausted := status.Error(codes.ResourceExhausted, "rate limited")
	tests := []struct {
		name     string
		err      error
		trailer  metadata.MD
		wantWait time.Duration
		wantOK   bool
	}{
		{name: "refusal with a wait", err: exhausted, trailer: metadata.Pairs("retry-after", "3"), wantWait: 3 * time.Second, wantOK: true},
		{name: "refusal without a trailer", err: exhausted},
		{name: "refusal with a wait that is no number", err: exhausted, trailer: metadata.Pairs("retry-after", "soon")},
		{name: "refusal with a zero wait", err: exhausted, trailer: metadata.Pairs("retry-after", "0")},
		{name: "another code", err: status.Error(codes.Unavailable, "down"), trailer: metadata.Pairs("retry-after", "3")},
		{name: "not a status", err: errors.New("boom"), trailer: metadata.Pairs("retry-after", "3")},
		{name: "no error", trailer: metadata.Pairs("retry-after", "3")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			wait, ok := brokerclient.RetryAfter(tt.err, tt.trailer)
			assert.Equal(t, tt.wantOK, ok)
			assert.Equal(t, tt.wantWait, wait)
		})
	}
}

// answer is what one call of WaitAndRetry's function returns.
type answer struct {
	wait time.Duration
	err  error
}

// WaitAndRetry waits as told, plus at most a fifth, while the waits fit in
// maxWait and before the context's deadline; it returns the last refusal,
// never the context's error, when it stops waiting.
func TestWaitAndRetry(t *testing.T) {
	refused := errors.New("refused")
	final := errors.New("final")
	refusal := func(secs int) answer { return answer{wait: time.Duration(secs) * time.Second, err: refused} }
	tests := []struct {
		name    string
		maxWait time.Duration
		// deadline, when set, is the context's, from now.
		deadline time.Duration
		// sleepErr ends every wait early, as when the context ends.
		sleepErr  error
		answers   []answer // then a result
		wantWaits []time.Duration
		wantCalls int
		wantErr   error
	}{
		{name: "at once", maxWait: time.Minute, wantCalls: 1},
		{name: "two refusals", maxWait: time.Minute, answers: []answer{refusal(1), refusal(2)},
			wantWaits: []time.Duration{time.Second, 2 * time.Second}, wantCalls: 3},
		{name: "a final error", maxWait: time.Minute, answers: []answer{{err: final}}, wantCalls: 1, wantErr: final},
		{name: "a final error after a wait", maxWait: time.Minute, answers: []answer{refusal(1), {err: final}},
			wantWaits: []time.Duration{time.Second}, wantCalls: 2, wantErr: final},
		{name: "the bound", maxWait: 10 * time.Second, answers: []answer{refusal(4), refusal(4), refusal(4)},
			wantWaits: []time.Duration{4 * time.Second, 4 * time.Second}, wantCalls: 3, wantErr: refused},
		{name: "a wait longer than the bound", maxWait: 4 * time.Second, answers: []answer{refusal(5)},
			wantCalls: 1, wantErr: refused},
		{name: "zero never waits", answers: []answer{refusal(1)}, wantCalls: 1, wantErr: refused},
		{name: "negative never waits", maxWait: -1, answers: []answer{refusal(1)}, wantCalls: 1, wantErr: refused},
		{name: "the deadline comes first", maxWait: time.Minute, deadline: 30 * time.Second,
			answers: []answer{refusal(40)}, wantCalls: 1, wantErr: refused},
		{name: "the context ends during the wait", maxWait: time.Minute, sleepErr: context.Canceled,
			answers: []answer{refusal(1)}, wantWaits: []time.Duration{time.Second}, wantCalls: 1, wantErr: refused},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := t.Context()
			if tt.deadline > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, tt.deadline)
				defer cancel()
			}
			var waits []time.Duration
			sleep := func(_ context.Context, d time.Duration) error {
				waits = append(waits, d)
				return tt.sleepErr
			}
			calls := 0
			got, err := brokerclient.WaitAndRetry(ctx, tt.maxWait, sleep, func() (string, time.Duration, error) {
				calls++
				if calls <= len(tt.answers) {
					a := tt.answers[calls-1]
					return "", a.wait, a.err
				}
				return "token", 0, nil
			})
			assert.Equal(t, tt.wantCalls, calls)
			require.Len(t, waits, len(tt.wantWaits), "waits %v", waits)
			for i, want := range tt.wantWaits {
				assert.GreaterOrEqual(t, waits[i], want)
				assert.LessOrEqual(t, waits[i], want+want/5)
			}
			if tt.wantErr != nil {
				assert.ErrorIs(t, err, tt.wantErr)
				assert.Empty(t, got)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, "token", got)
		})
	}
}

// Without a sleep of the caller's, WaitAndRetry waits on a timer, and
// stops waiting when the context ends.
func TestWaitAndRetryTimer(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	calls := 0
	done := make(chan error, 1)
	go func() {
		_, err := brokerclient.WaitAndRetry(ctx, time.Hour, nil, func() (int, time.Duration, error) {
			calls++
			return 0, time.Minute, errors.New("refused")
		})
		done <- err
	}()
	cancel()
	select {
	case err := <-done:
		assert.EqualError(t, err, "refused")
		assert.Equal(t, 1, calls)
	case <-time.After(10 * time.Second):
		t.Fatal("WaitAndRetry did not stop waiting when its context ended")
	}
}
