package probe

import (
	"crypto/x509"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	testingclock "k8s.io/utils/clock/testing"
)

type fakeSource struct {
	svid *x509svid.SVID
	err  error
}

func (f fakeSource) GetX509SVID() (*x509svid.SVID, error) { return f.svid, f.err }

func svidUntil(notAfter ...time.Time) *x509svid.SVID {
	s := &x509svid.SVID{ID: spiffeid.RequireFromString("spiffe://test.example/broker")}
	for _, t := range notAfter {
		s.Certificates = append(s.Certificates, &x509.Certificate{NotAfter: t})
	}
	return s
}

// svidFor is an SVID valid from notBefore for life.
func svidFor(notBefore time.Time, life time.Duration) *x509svid.SVID {
	s := svidUntil(notBefore.Add(life))
	s.Certificates[0].NotBefore = notBefore
	return s
}

func TestSVIDValid(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	tests := []struct {
		name    string
		src     fakeSource
		wantErr string
	}{
		{name: "an hour left", src: fakeSource{svid: svidUntil(now.Add(time.Hour))}},
		{name: "just over a minute left", src: fakeSource{svid: svidUntil(now.Add(time.Minute + time.Second))}},
		{name: "exactly a minute left", src: fakeSource{svid: svidUntil(now.Add(time.Minute))},
			wantErr: "the SVID spiffe://test.example/broker expires at 2026-01-01T00:01:00Z, in 1m0s or less"},
		{name: "expired", src: fakeSource{svid: svidUntil(now.Add(-time.Second))}, wantErr: "expires at 2025-12-31T23:59:59Z"},
		{name: "an intermediate expires first", src: fakeSource{svid: svidUntil(now.Add(time.Hour), now.Add(30*time.Second))},
			wantErr: "expires at 2026-01-01T00:00:30Z"},
		{name: "a 90s SVID at half life", src: fakeSource{svid: svidFor(now.Add(-45*time.Second), 90*time.Second)}},
		{name: "a 90s SVID with a fifth of it left", src: fakeSource{svid: svidFor(now.Add(-72*time.Second), 90*time.Second)},
			wantErr: "in 22.5s or less"},
		{name: "no SVID", src: fakeSource{err: errors.New("not loaded")}, wantErr: "no SVID: not loaded"},
		{name: "no certificate", src: fakeSource{svid: svidUntil()}, wantErr: "no SVID: the source holds no certificate"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := SVIDValid(tt.src, testingclock.NewFakePassiveClock(now), MinSVIDLifetime)()
			if tt.wantErr == "" {
				assert.NoError(t, err)
				return
			}
			require.Error(t, err)
			assert.Contains(t, err.Error(), tt.wantErr)
		})
	}
}

// The SVID check follows the clock: ready now, not ready once less than a
// minute is left.
func TestSVIDValidFollowsTheClock(t *testing.T) {
	clk := testingclock.NewFakeClock(time.Now())
	check := SVIDValid(fakeSource{svid: svidUntil(clk.Now().Add(10 * time.Minute))}, clk, MinSVIDLifetime)
	require.NoError(t, check())
	clk.Step(9 * time.Minute)
	assert.Error(t, check())
}

func TestReadyz(t *testing.T) {
	now := time.Now()
	var synced, draining atomic.Bool
	clk := testingclock.NewFakeClock(now)
	ready := All(
		Synced("informer not synced", synced.Load),
		SVIDValid(fakeSource{svid: svidUntil(now.Add(time.Hour))}, clk, MinSVIDLifetime),
		NotDraining(&draining),
	)
	mux := http.NewServeMux()
	Serve(mux, All(), ready)
	get := func(path string) (int, string) {
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
		return rec.Code, rec.Body.String()
	}

	code, body := get("/readyz")
	assert.Equal(t, http.StatusServiceUnavailable, code)
	assert.Contains(t, body, "informer not synced")

	synced.Store(true)
	code, body = get("/readyz")
	assert.Equal(t, http.StatusOK, code, body)

	clk.Step(59 * time.Minute)
	code, body = get("/readyz")
	assert.Equal(t, http.StatusServiceUnavailable, code)
	assert.Contains(t, body, "expires at")
	clk.SetTime(now)

	draining.Store(true)
	code, body = get("/readyz")
	assert.Equal(t, http.StatusServiceUnavailable, code)
	assert.Contains(t, body, "draining")

	// Draining is no reason to restart the process.
	code, _ = get("/healthz")
	assert.Equal(t, http.StatusOK, code)
}
