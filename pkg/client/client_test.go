package client_test

import (
	"context"
	"crypto/tls"
	"encoding/base64"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/client-go/rest"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/credbroker/credbroker/pkg/client"
	"github.com/credbroker/credbroker/pkg/errdefs"
)

var epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// setup starts a fake broker whose tokens live an hour, and a Client on a
// fake clock.
func setup(t *testing.T) (*fakeBroker, *client.Client, *clocktesting.FakeClock) {
	t.Helper()
	clk := clocktesting.NewFakeClock(epoch)
	b, err := startFakeBroker(clk, time.Hour)
	require.NoError(t, err)
	t.Cleanup(b.Close)
	c, err := client.New(client.Config{
		Address:     b.Address,
		TLS:         &tls.Config{RootCAs: b.Roots, MinVersion: tls.VersionTLS12},
		TokenSource: client.StaticTokenSource("hub-token"),
		Clock:       clk,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return b, c, clk
}

// get sends one GET through a client built from cfg and returns the status.
func get(t *testing.T, cfg *rest.Config) int {
	t.Helper()
	hc, err := rest.HTTPClientFor(cfg)
	require.NoError(t, err)
	resp, err := hc.Get(cfg.Host + "/api/v1/namespaces")
	require.NoError(t, err)
	_ = resp.Body.Close()
	return resp.StatusCode
}

// A token is used until half its lifetime has passed, and no longer.
func TestRefreshBeforeHalfLife(t *testing.T) {
	tests := []struct {
		name          string
		advance       time.Duration
		wantExchanges int
		wantToken     string
	}{
		{"just fetched", 0, 1, "spoke-token-1"},
		{"before half life", 29 * time.Minute, 1, "spoke-token-1"},
		{"at half life", 30 * time.Minute, 2, "spoke-token-2"},
		{"near expiry", 59 * time.Minute, 2, "spoke-token-2"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, c, clk := setup(t)
			cfg, err := c.RESTConfigFor(t.Context(), "fleet", "spoke")
			require.NoError(t, err)
			clk.Step(tt.advance)
			require.Equal(t, http.StatusOK, get(t, cfg))
			assert.Equal(t, tt.wantExchanges, b.Exchanges())
			seen := b.Spoke.Seen()
			assert.Equal(t, tt.wantToken, seen[len(seen)-1])
		})
	}
}

// A 401 from the spoke drops the token, and the request is sent once more
// with a new one; a second 401 is the caller's.
func TestRefetchAfter401(t *testing.T) {
	tests := []struct {
		name          string
		reject        []string
		wantStatus    int
		wantSeen      []string
		wantExchanges int
	}{
		{"accepted", nil, http.StatusOK, []string{"spoke-token-1"}, 1},
		{"revoked token is replaced", []string{"spoke-token-1"}, http.StatusOK, []string{"spoke-token-1", "spoke-token-2"}, 2},
		{"retried only once", []string{"spoke-token-1", "spoke-token-2", "spoke-token-3"}, http.StatusUnauthorized,
			[]string{"spoke-token-1", "spoke-token-2"}, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, c, _ := setup(t)
			cfg, err := c.RESTConfigFor(t.Context(), "fleet", "spoke")
			require.NoError(t, err)
			for _, tok := range tt.reject {
				b.Spoke.Reject(tok)
			}
			assert.Equal(t, tt.wantStatus, get(t, cfg))
			assert.Equal(t, tt.wantSeen, b.Spoke.Seen())
			assert.Equal(t, tt.wantExchanges, b.Exchanges())
		})
	}
}

// Every config of a ClusterProfile, and every client built from them, uses
// one token cache; another ClusterProfile has its own.
func TestTokenSharedAcrossClients(t *testing.T) {
	b, c, clk := setup(t)
	cfg1, err := c.RESTConfigFor(t.Context(), "fleet", "spoke")
	require.NoError(t, err)
	cfg2, err := c.RESTConfigFor(t.Context(), "fleet", "spoke")
	require.NoError(t, err)
	for _, cfg := range []*rest.Config{cfg1, cfg2, rest.CopyConfig(cfg1)} {
		require.Equal(t, http.StatusOK, get(t, cfg))
	}
	assert.Equal(t, 1, b.Exchanges(), "one token for every client of the ClusterProfile")

	// One refresh serves them all.
	clk.Step(31 * time.Minute)
	for _, cfg := range []*rest.Config{cfg1, cfg2} {
		require.Equal(t, http.StatusOK, get(t, cfg))
	}
	assert.Equal(t, 2, b.Exchanges())

	_, err = c.RESTConfigFor(t.Context(), "fleet", "other")
	require.NoError(t, err)
	assert.Equal(t, 3, b.Exchanges(), "another ClusterProfile has its own token")
}

// The config holds no token: a copy, a log line or a dump of it leaks
// nothing, and nothing in it execs a process.
func TestTokenNotInConfig(t *testing.T) {
	b, c, _ := setup(t)
	cfg, err := c.RESTConfigFor(t.Context(), "fleet", "spoke")
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, get(t, cfg))
	tok := b.Spoke.Seen()[0]
	require.NotEmpty(t, tok)

	assert.Equal(t, b.Spoke.URL, cfg.Host)
	assert.Equal(t, b.Spoke.CAData, cfg.CAData)
	assert.Empty(t, cfg.BearerToken)
	assert.Empty(t, cfg.BearerTokenFile)
	assert.Empty(t, cfg.Username)
	assert.Empty(t, cfg.Password)
	assert.Nil(t, cfg.ExecProvider)
	assert.Nil(t, cfg.AuthProvider)
	assert.Nil(t, cfg.AuthConfigPersister)
	for _, format := range []string{"%v", "%+v", "%#v", "%s"} {
		assert.NotContains(t, fmt.Sprintf(format, cfg), tok, format)
		assert.NotContains(t, fmt.Sprintf(format, *cfg), tok, format)
	}
	// No string field anywhere in the struct holds the token.
	v := reflect.ValueOf(*cfg)
	for i := range v.NumField() {
		assert.NotContains(t, fmt.Sprintf("%#v", v.Field(i).Interface()), tok, v.Type().Field(i).Name)
	}
}

// The broker's answer is where the token goes: an answer without a server
// gives no config, and a config sends no token for a server or CA other
// than its own.
func TestServerPin(t *testing.T) {
	t.Run("answer without a server", func(t *testing.T) {
		b, c, _ := setup(t)
		b.AnswerServer("")
		cfg, err := c.RESTConfigFor(t.Context(), "fleet", "spoke")
		require.ErrorIs(t, err, errdefs.ErrFailedPrecondition)
		assert.Nil(t, cfg)
		assert.Contains(t, err.Error(), "fleet/spoke")
	})
	t.Run("answer with a plain http server", func(t *testing.T) {
		b, c, _ := setup(t)
		var mu sync.Mutex
		var seen []string
		plain := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			seen = append(seen, r.Header.Get("Authorization"))
			mu.Unlock()
			w.WriteHeader(http.StatusNotFound)
		}))
		t.Cleanup(plain.Close)
		b.AnswerServer(plain.URL)
		cfg, err := c.RESTConfigFor(t.Context(), "fleet", "spoke")
		if err == nil {
			get(t, cfg) // what the caller does next
		}
		mu.Lock()
		assert.Empty(t, seen, "a request reached the http server, the token in cleartext")
		mu.Unlock()
		require.ErrorIs(t, err, errdefs.ErrPermissionDenied)
		assert.Nil(t, cfg)
		assert.Contains(t, err.Error(), "fleet/spoke")
		assert.Contains(t, err.Error(), plain.URL)
		assert.Contains(t, err.Error(), "not an https URL")
		assert.NotContains(t, err.Error(), "spoke-token-")
	})
	t.Run("answer with an https server that is no API server URL", func(t *testing.T) {
		for _, tt := range []struct{ server, want string }{
			{server: "https://u:secret@spoke.example", want: "it has user information"},
			{server: "https://spoke.example?x=1", want: "it has a query"},
			{server: "https://spoke.example#frag", want: "it has a fragment"},
			{server: "https://:6443", want: "it has no host"},
		} {
			t.Run(tt.server, func(t *testing.T) {
				b, c, _ := setup(t)
				b.AnswerServer(tt.server)
				cfg, err := c.RESTConfigFor(t.Context(), "fleet", "spoke")
				require.ErrorIs(t, err, errdefs.ErrPermissionDenied)
				assert.Nil(t, cfg)
				assert.Contains(t, err.Error(), "fleet/spoke")
				assert.Contains(t, err.Error(), tt.want)
				assert.NotContains(t, err.Error(), "secret")
				assert.NotContains(t, err.Error(), "spoke-token-")
			})
		}
	})
	t.Run("server changed after the config was built", func(t *testing.T) {
		b, c, clk := setup(t)
		cfg, err := c.RESTConfigFor(t.Context(), "fleet", "spoke")
		require.NoError(t, err)
		b.AnswerServer("https://attacker.example")
		clk.Step(31 * time.Minute)
		hc, err := rest.HTTPClientFor(cfg)
		require.NoError(t, err)
		_, err = hc.Get(cfg.Host + "/api/v1/namespaces")
		require.ErrorIs(t, err, errdefs.ErrPermissionDenied)
		assert.NotContains(t, b.Spoke.Seen(), "spoke-token-2", "the new server's token did not reach the old server")
	})
	t.Run("broker error", func(t *testing.T) {
		_, c, _ := setup(t)
		_, err := c.RESTConfigFor(t.Context(), "fleet", "missing")
		require.ErrorIs(t, err, errdefs.ErrNotFound)
		assert.Contains(t, err.Error(), "fleet/missing")
	})
}

func TestNewValidates(t *testing.T) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	tests := []struct {
		name string
		cfg  client.Config
	}{
		{"no address", client.Config{TLS: tc, TokenSource: client.StaticTokenSource("x")}},
		{"no TLS", client.Config{Address: "b:443", TokenSource: client.StaticTokenSource("x")}},
		{"insecure", client.Config{Address: "b:443", TLS: &tls.Config{InsecureSkipVerify: true}, TokenSource: client.StaticTokenSource("x")}},
		{"no token source", client.Config{Address: "b:443", TLS: tc}},
		{"negative timeout", client.Config{Address: "b:443", TLS: tc, TokenSource: client.StaticTokenSource("x"), Timeout: -1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := client.New(tt.cfg)
			assert.Error(t, err)
		})
	}
}

// jwt returns a JWT-shaped token with the given exp claim and a marker.
func jwt(marker string, exp time.Time) string {
	enc := base64.RawURLEncoding.EncodeToString
	return enc([]byte(`{"alg":"RS256"}`)) + "." +
		enc(fmt.Appendf(nil, `{"exp":%d,"sub":%q}`, exp.Unix(), marker)) + "." + enc([]byte("sig"))
}

// The kubelet rotates the projected token: the source reads the new one
// when the file changes, after its reread interval, and once the token it
// holds has expired, and never serves a token past its exp.
func TestFileTokenSourceRereadsRotatedToken(t *testing.T) {
	dir := t.TempDir()
	name := filepath.Join(dir, "token")
	clk := clocktesting.NewFakeClock(epoch)
	first, second := jwt("a", epoch.Add(time.Hour)), jwt("b", epoch.Add(2*time.Hour))
	require.Len(t, second, len(first))
	require.NoError(t, os.WriteFile(name, []byte(first), 0o600))
	src, err := client.NewFileTokenSource(name, 10*time.Minute, clk)
	require.NoError(t, err)
	got, err := src.Token(t.Context())
	require.NoError(t, err)
	require.Equal(t, first, got)

	// Rewrite in place with the same size and modification time, so only
	// the clock can tell.
	info, err := os.Stat(name)
	require.NoError(t, err)
	rewrite := func(tok string) {
		require.NoError(t, os.WriteFile(name, []byte(tok), 0o600))
		require.NoError(t, os.Chtimes(name, info.ModTime(), info.ModTime()))
	}
	rewrite(second)
	got, err = src.Token(t.Context())
	require.NoError(t, err)
	assert.Equal(t, first, got, "unchanged file, within the interval")
	clk.Step(10 * time.Minute)
	got, err = src.Token(t.Context())
	require.NoError(t, err)
	assert.Equal(t, second, got, "after the interval")

	// A token past its exp is read again even within the interval.
	src, err = client.NewFileTokenSource(name, 24*time.Hour, clk)
	require.NoError(t, err)
	expiring := jwt("c", clk.Now().Add(time.Minute))
	require.Len(t, expiring, len(first))
	rewrite(expiring)
	got, err = src.Token(t.Context())
	require.NoError(t, err)
	require.Equal(t, expiring, got)
	rewrite(second)
	clk.Step(time.Minute)
	got, err = src.Token(t.Context())
	require.NoError(t, err)
	assert.Equal(t, second, got, "past the exp of the token held")

	// The kubelet swaps the file: read at once.
	third := jwt("d", clk.Now().Add(time.Hour))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "new"), []byte(third), 0o600))
	require.NoError(t, os.Rename(filepath.Join(dir, "new"), name))
	got, err = src.Token(t.Context())
	require.NoError(t, err)
	assert.Equal(t, third, got, "after the file changed")

	// An unreadable file is an error that names it, never a stale token.
	require.NoError(t, os.Remove(name))
	_, err = src.Token(t.Context())
	require.Error(t, err)
	assert.Contains(t, err.Error(), name)
	assert.NotContains(t, err.Error(), third)
}

// A fetch refused by the broker's rate limit waits as the retry-after
// trailer tells (plus at most a fifth), and asks again, for MaxRetryWait in
// all; a refusal without a trailer, or one that would wait longer, is the
// caller's at once.
func TestWaitsAsTheBrokerTells(t *testing.T) {
	tests := []struct {
		name         string
		maxRetryWait time.Duration
		refuse       []int
		wantErr      bool
		wantWaits    []time.Duration // each at least this, at most a fifth more
	}{
		{name: "one refusal", refuse: []int{1}, wantWaits: []time.Duration{time.Second}},
		{name: "two refusals", refuse: []int{2, 3}, wantWaits: []time.Duration{2 * time.Second, 3 * time.Second}},
		{name: "no trailer", refuse: []int{0}, wantErr: true},
		{name: "longer than the bound", maxRetryWait: 10 * time.Second, refuse: []int{4, 4, 4}, wantErr: true,
			wantWaits: []time.Duration{4 * time.Second, 4 * time.Second}},
		{name: "never waits", maxRetryWait: -1, refuse: []int{1}, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clk := clocktesting.NewFakeClock(epoch)
			b, err := startFakeBroker(clk, time.Hour)
			require.NoError(t, err)
			t.Cleanup(b.Close)
			c, err := client.New(client.Config{
				Address:      b.Address,
				TLS:          &tls.Config{RootCAs: b.Roots, MinVersion: tls.VersionTLS12},
				TokenSource:  client.StaticTokenSource("hub-token"),
				Clock:        clk,
				MaxRetryWait: tt.maxRetryWait,
			})
			require.NoError(t, err)
			t.Cleanup(func() { _ = c.Close() })
			var waits []time.Duration
			client.SetSleep(c, func(_ context.Context, d time.Duration) error {
				waits = append(waits, d)
				return nil
			})
			b.Refuse(tt.refuse...)

			_, err = c.RESTConfigFor(t.Context(), "fleet", "spoke")
			if tt.wantErr {
				require.Error(t, err)
				assert.ErrorIs(t, err, errdefs.ErrResourceExhausted)
				assert.Zero(t, b.Exchanges())
			} else {
				require.NoError(t, err)
				assert.Equal(t, 1, b.Exchanges())
				assert.Equal(t, len(tt.refuse), b.Refused())
			}
			require.Len(t, waits, len(tt.wantWaits))
			for i, want := range tt.wantWaits {
				assert.GreaterOrEqual(t, waits[i], want)
				assert.LessOrEqual(t, waits[i], want+want/5)
			}
		})
	}
}
