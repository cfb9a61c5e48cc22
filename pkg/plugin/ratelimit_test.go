package plugin_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/plugin"
)

// rateLimited is the broker's refusal over a consumer's rate limit, with a
// retry-after trailer of secs seconds ("" for none). Its message carries the
// hub token, which no error may.
func rateLimited(secs string) refusal {
	return refusal{code: codes.ResourceExhausted, retryAfter: secs,
		msg: "system:serviceaccount:apps:ci asked for more than 20 mints per second (burst 2000); token " + testHubToken}
}

// A GetToken refused by the broker's rate limit with a retry-after waits as
// told (plus at most a fifth) and asks again, for MaxRetryWait in all, and
// then returns the token; a refusal without a usable retry-after, another
// code, or a wait that would not fit is the caller's at once. The waits are
// recorded, not slept.
func TestGetTokenWaitsOutRateLimit(t *testing.T) {
	tests := []struct {
		name         string
		timeout      time.Duration
		maxRetryWait time.Duration
		refuse       []refusal
		// cancel makes the wait end with the context, as when the caller
		// gives up.
		cancel bool
		// wantWaits are the waits asked for; each is slept plus at most a fifth.
		wantWaits []time.Duration
		wantCode  codes.Code // OK: the token is returned
	}{
		{name: "one refusal", refuse: []refusal{rateLimited("1")}, wantWaits: []time.Duration{time.Second}},
		{
			name:      "three refusals",
			refuse:    []refusal{rateLimited("1"), rateLimited("2"), rateLimited("3")},
			wantWaits: []time.Duration{time.Second, 2 * time.Second, 3 * time.Second},
		},
		{
			// Timeout bounds each exchange, not the waits between them.
			name: "a wait longer than the timeout", timeout: 5 * time.Second,
			refuse: []refusal{rateLimited("10")}, wantWaits: []time.Duration{10 * time.Second},
		},
		{
			// 4s and 4.8s at most fit in 10s; a third wait of 4s would not.
			name: "bound reached", maxRetryWait: 10 * time.Second,
			refuse:    []refusal{rateLimited("4"), rateLimited("4"), rateLimited("4")},
			wantWaits: []time.Duration{4 * time.Second, 4 * time.Second}, wantCode: codes.ResourceExhausted,
		},
		{
			// DefaultMaxRetryWait is 30s: 20s fits, 20s more does not.
			name:      "default bound reached",
			refuse:    []refusal{rateLimited("20"), rateLimited("20")},
			wantWaits: []time.Duration{20 * time.Second}, wantCode: codes.ResourceExhausted,
		},
		{
			name: "a wait longer than the bound is not begun", refuse: []refusal{rateLimited("31")},
			wantCode: codes.ResourceExhausted,
		},
		{
			name: "never waits", maxRetryWait: -1, refuse: []refusal{rateLimited("1")},
			wantCode: codes.ResourceExhausted,
		},
		{name: "no retry-after", refuse: []refusal{rateLimited("")}, wantCode: codes.ResourceExhausted},
		{name: "retry-after that is no number of seconds", refuse: []refusal{rateLimited("soon")}, wantCode: codes.ResourceExhausted},
		{
			name:     "retry-after on another code",
			refuse:   []refusal{{code: codes.PermissionDenied, msg: "hub RBAC does not allow it", retryAfter: "1"}},
			wantCode: codes.PermissionDenied,
		},
		{
			name: "caller gives up during the wait", refuse: []refusal{rateLimited("1")}, cancel: true,
			wantWaits: []time.Duration{time.Second}, wantCode: codes.ResourceExhausted,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := startBroker(t, okResponse)
			b.fake.refuse(tt.refuse...)
			p, err := plugin.New(plugin.Config{
				BrokerAddress: b.addr, TLS: b.clientTLS, TokenFile: b.tokenFile, Timeout: tt.timeout, MaxRetryWait: tt.maxRetryWait,
			})
			require.NoError(t, err)
			var waits []time.Duration
			plugin.SetSleep(p, func(ctx context.Context, d time.Duration) error {
				waits = append(waits, d)
				if tt.cancel {
					return context.Canceled
				}
				return ctx.Err()
			})

			got, err := p.GetToken(t.Context(), execCredential(prodConfig))

			require.Len(t, waits, len(tt.wantWaits), "waits %v", waits)
			for i, want := range tt.wantWaits {
				assert.GreaterOrEqual(t, waits[i], want)
				assert.LessOrEqual(t, waits[i], want+want/5)
			}
			requests := len(b.fake.received())
			if tt.wantCode != codes.OK {
				require.Error(t, err)
				t.Logf("GetToken error: %v", err)
				assert.Equal(t, tt.wantCode, errdefs.Code(err), "error: %v", err)
				assert.Contains(t, err.Error(), "exchange for cluster fleet/prod-eu-1")
				assert.NotContains(t, err.Error(), testHubToken)
				assert.Empty(t, got.Token)
				// The first call, and one after each wait that ran its course.
				wantRequests := len(tt.wantWaits) + 1
				if tt.cancel {
					wantRequests--
				}
				assert.Equal(t, wantRequests, requests)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, testSpokeToken, got.Token)
			require.NotNil(t, got.ExpirationTimestamp)
			assert.True(t, testExpiry.Equal(got.ExpirationTimestamp.Time))
			assert.Equal(t, len(tt.refuse)+1, requests, "each refusal is asked again")
		})
	}
}
