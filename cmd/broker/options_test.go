package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// kubeconfig writes a minimal kubeconfig for the hub and returns its path.
func kubeconfig(t *testing.T) string {
	t.Helper()
	name := filepath.Join(t.TempDir(), "kubeconfig")
	require.NoError(t, os.WriteFile(name, []byte(`apiVersion: v1
kind: Config
clusters: [{name: hub, cluster: {server: "https://hub.example:6443"}}]
users: [{name: broker, user: {token: not-a-real-token}}]
contexts: [{name: hub, context: {cluster: hub, user: broker}}]
current-context: hub
`), 0o600))
	return name
}

// requiredFlags are the flags parseFlags cannot do without. The files need
// not exist: parseFlags does not read them.
func requiredFlags(t *testing.T) []string {
	t.Helper()
	return []string{
		"--tls-cert-file", "/tls/tls.crt", "--tls-key-file", "/tls/tls.key",
		"--svid-cert-file", "/svid/cert.pem", "--svid-key-file", "/svid/key.pem", "--trust-bundle-file", "/svid/bundle.pem",
		"--trust-domain", "fleet.example", "--kubeconfig", kubeconfig(t),
	}
}

func TestParseFlagsNumbers(t *testing.T) {
	required := requiredFlags(t)
	tests := []struct {
		name    string
		args    []string
		wantQPS float32
		wantErr string
	}{
		{name: "default", wantQPS: 200},
		{name: "integer", args: []string{"--hub-qps", "250"}, wantQPS: 250},
		{name: "fraction", args: []string{"--hub-qps=12.5"}, wantQPS: 12.5},
		{name: "exponent", args: []string{"--hub-qps=1e3"}, wantQPS: 1000},
		{name: "trailing garbage", args: []string{"--hub-qps=200abc"}, wantErr: `invalid argument "200abc" for "--hub-qps" flag`},
		{name: "trailing space", args: []string{"--hub-qps=200 "}, wantErr: `invalid argument "200 " for "--hub-qps" flag`},
		{name: "two numbers", args: []string{"--hub-qps=200 300"}, wantErr: `invalid argument "200 300" for "--hub-qps" flag`},
		{name: "empty", args: []string{"--hub-qps="}, wantErr: `invalid argument "" for "--hub-qps" flag`},
		{name: "not a number", args: []string{"--hub-qps=fast"}, wantErr: `invalid argument "fast" for "--hub-qps" flag`},
		{name: "NaN", args: []string{"--hub-qps=NaN"}, wantErr: `invalid argument "NaN" for "--hub-qps" flag`},
		{name: "infinite", args: []string{"--hub-qps=Inf"}, wantErr: `invalid argument "Inf" for "--hub-qps" flag`},
		{name: "beyond float32", args: []string{"--hub-qps=1e39"}, wantErr: `invalid argument "1e39" for "--hub-qps" flag`},
		{name: "zero", args: []string{"--hub-qps=0"}, wantErr: "hub QPS and burst must be positive"},
		{name: "negative", args: []string{"--hub-qps=-1"}, wantErr: "hub QPS and burst must be positive"},
		{name: "integer flag with trailing garbage", args: []string{"--hub-burst=400x"}, wantErr: `invalid argument "400x" for "--hub-burst" flag`},
		{name: "float64 flag with trailing garbage", args: []string{"--rate-limit=20/s"}, wantErr: `invalid argument "20/s" for "--rate-limit" flag`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, _, err := parseFlags(append(append([]string(nil), required...), tt.args...))
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.wantQPS, cfg.HubQPS)
		})
	}
}

func TestParseFlagsReflection(t *testing.T) {
	required := requiredFlags(t)
	cfg, _, err := parseFlags(required)
	require.NoError(t, err)
	assert.False(t, cfg.EnableReflection, "reflection is off by default")

	cfg, _, err = parseFlags(append(required, "--enable-reflection"))
	require.NoError(t, err)
	assert.True(t, cfg.EnableReflection)
}

func TestParseFlagsProfiling(t *testing.T) {
	required := requiredFlags(t)
	cfg, _, err := parseFlags(required)
	require.NoError(t, err)
	assert.False(t, cfg.Profiling, "pprof is off by default")

	cfg, _, err = parseFlags(append(required, "--profiling"))
	require.NoError(t, err)
	assert.True(t, cfg.Profiling)
}

func TestParseFlagsGrantTriggers(t *testing.T) {
	required := requiredFlags(t)
	cfg, _, err := parseFlags(required)
	require.NoError(t, err)
	assert.Equal(t, 5*time.Minute, cfg.GrantRecheckInterval)
	assert.Equal(t, 2*time.Second, cfg.RBACDebounce)
	assert.Equal(t, 5*time.Second, cfg.RBACDebounceMax)

	cfg, _, err = parseFlags(append(required, "--grant-recheck-interval=1m", "--rbac-debounce=500ms", "--rbac-debounce-max=1s",
		"--grant-review-rate-limit=5", "--grant-review-burst=7"))
	require.NoError(t, err)
	assert.Equal(t, time.Minute, cfg.GrantRecheckInterval)
	assert.Equal(t, 500*time.Millisecond, cfg.RBACDebounce)
	assert.Equal(t, time.Second, cfg.RBACDebounceMax)
	assert.Equal(t, 5.0, cfg.GrantReviewRateLimit)
	assert.Equal(t, 7, cfg.GrantReviewBurst)

	_, _, err = parseFlags(append(required, "--rbac-debounce=10s"))
	require.ErrorContains(t, err, "the RBAC debounce must be positive and at most its maximum (10s, 5s)")
}

// The Leases and the pending revokes live in the broker's own namespace
// unless a flag names another; outside a pod, credbroker-system.
func TestParseFlagsNamespaces(t *testing.T) {
	required := requiredFlags(t)
	cfg, _, err := parseFlags(append(required, "--publish-access-provider"))
	require.NoError(t, err)
	assert.Equal(t, "credbroker-system", cfg.PublishLeaseNamespace)
	assert.Equal(t, "credbroker-system", cfg.PendingRevokesNamespace)

	cfg, _, err = parseFlags(append(required, "--publish-access-provider", "--publish-lease-namespace=fleet-ops", "--pending-revokes-namespace=fleet-ops"))
	require.NoError(t, err)
	assert.Equal(t, "fleet-ops", cfg.PublishLeaseNamespace)
	assert.Equal(t, "fleet-ops", cfg.PendingRevokesNamespace)
}

func TestParseFlagsSVIDSource(t *testing.T) {
	base := []string{"--tls-cert-file", "/tls/tls.crt", "--tls-key-file", "/tls/tls.key", "--trust-domain", "fleet.example", "--kubeconfig", kubeconfig(t)}
	files := []string{"--svid-cert-file", "/svid/cert.pem", "--svid-key-file", "/svid/key.pem", "--trust-bundle-file", "/svid/bundle.pem"}
	socket := []string{"--spiffe-endpoint-socket", "unix:///run/spire/agent-sockets/spire-agent.sock"}
	tests := []struct {
		name    string
		args    []string
		wantErr string
	}{
		{name: "files", args: files},
		{name: "socket", args: socket},
		{name: "socket and own ID", args: append(socket, "--spiffe-id", "spiffe://fleet.example/hub/broker")},
		{name: "neither", wantErr: "an SVID source is required: the Workload API socket (--spiffe-endpoint-socket), " +
			"or an SVID certificate, key and trust bundle (--svid-cert-file, --svid-key-file, --trust-bundle-file)"},
		{name: "some files", args: files[:4], wantErr: "an SVID source is required"},
		{name: "both", args: append(append([]string(nil), files...), socket...), wantErr: "set either the Workload API socket (--spiffe-endpoint-socket) " +
			"or the SVID files (--svid-cert-file, --svid-key-file, --trust-bundle-file), not both"},
		{name: "socket and one file", args: append([]string{"--trust-bundle-file", "/b.pem"}, socket...), wantErr: "not both"},
		{name: "socket not a URL", args: []string{"--spiffe-endpoint-socket", "/run/spire.sock"}, wantErr: `the Workload API socket (--spiffe-endpoint-socket) "/run/spire.sock"`},
		{name: "ID of another trust domain", args: append(socket, "--spiffe-id", "spiffe://other.example/broker"), wantErr: "the broker's SPIFFE ID spiffe://other.example/broker is not in trust domain"},
		{name: "not an ID", args: append(socket, "--spiffe-id", "broker"), wantErr: "--spiffe-id:"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, _, err := parseFlags(append(append([]string(nil), base...), tt.args...))
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, slices.Contains(tt.args, "--spiffe-endpoint-socket"), cfg.SPIFFEEndpointSocket != "")
		})
	}
}

func TestParseFlagsLimitsAndShutdown(t *testing.T) {
	required := requiredFlags(t)
	tests := []struct {
		name                 string
		args                 []string
		wantStreams          int
		wantConcurrent       uint32
		wantGrace, wantDelay time.Duration
		wantErr              string
	}{
		{name: "defaults fit a 200-node DaemonSet", wantStreams: 512, wantConcurrent: 1000, wantGrace: 15 * time.Second},
		{name: "set", args: []string{"--max-streams-per-cluster=1000", "--max-concurrent-streams=50", "--shutdown-grace=20s", "--shutdown-delay=3s"},
			wantStreams: 1000, wantConcurrent: 50, wantGrace: 20 * time.Second, wantDelay: 3 * time.Second},
		{name: "no streams", args: []string{"--max-streams-per-cluster=0"}, wantErr: "the agent streams per cluster must be positive"},
		{name: "no concurrent streams", args: []string{"--max-concurrent-streams=0"}, wantErr: `invalid argument "0" for "--max-concurrent-streams" flag`},
		{name: "concurrent streams beyond uint32", args: []string{"--max-concurrent-streams=4294967296"}, wantErr: "not a positive 32-bit integer"},
		{name: "delay as long as the grace", args: []string{"--shutdown-delay=15s"}, wantErr: "the shutdown delay less than it"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, _, err := parseFlags(append(append([]string{}, required...), tt.args...))
			if tt.wantErr != "" {
				require.Error(t, err)
				assert.Contains(t, err.Error(), tt.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.wantStreams, cfg.MaxStreamsPerCluster)
			assert.Equal(t, tt.wantConcurrent, cfg.MaxConcurrentStreams)
			assert.Equal(t, tt.wantGrace, cfg.ShutdownGrace)
			assert.Equal(t, tt.wantDelay, cfg.ShutdownDelay)
		})
	}
}

func TestParseFlagsLogsAndAudit(t *testing.T) {
	required := requiredFlags(t)
	dir := t.TempDir()
	tests := []struct {
		name    string
		args    []string
		wantErr string
		// wantFile is where the audit lines must go; empty: standard output.
		wantFile string
	}{
		{name: "defaults: audit to standard output"},
		{name: "audit file, text logs", args: []string{"--audit-log-path", filepath.Join(dir, "a.log"), "--log-format=text", "-v", "2"}, wantFile: filepath.Join(dir, "a.log")},
		{name: "audit file, json logs", args: []string{"--audit-log-path=" + filepath.Join(dir, "b.log"), "--log-format=json", "--v=1",
			"--audit-log-max-size=1", "--audit-log-max-backups=0"}, wantFile: filepath.Join(dir, "b.log")},
		{name: "single-dash long flags still work", args: []string{"-audit-log-path=" + filepath.Join(dir, "c.log")}, wantFile: filepath.Join(dir, "c.log")},
		{name: "bad log format", args: []string{"--log-format=logfmt"}, wantErr: `--log-format "logfmt": want "text" or "json"`},
		{name: "zero size", args: []string{"--audit-log-max-size=0"}, wantErr: "--audit-log-max-size 0 is not a positive number of MiB"},
		{name: "negative backups", args: []string{"--audit-log-max-backups=-1"}, wantErr: "--audit-log-max-backups -1 is negative"},
		{name: "unwritable audit path", args: []string{"--audit-log-path", filepath.Join(dir, "no", "such", "dir", "a.log")}, wantErr: "--audit-log-path:"},
		{name: "short verbosity with =", args: []string{"-v=2"}},
		{name: "version", args: []string{"--version"}, wantErr: "version requested"},
		{name: "verbosity and version", args: []string{"-v=2", "--version"}, wantErr: "version requested"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, closer, err := parseFlags(append(append([]string(nil), required...), tt.args...))
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			require.NotNil(t, closer)
			if tt.wantFile == "" {
				require.NoError(t, closer.Close())
				return
			}
			// Audit lines are JSON whatever --log-format is; the exchange
			// encodes its own into the same file.
			assert.Equal(t, closer, cfg.AuditLog)
			cfg.Audit.Info("exchange", "code", "OK")
			require.NoError(t, closer.Close())
			data, err := os.ReadFile(tt.wantFile)
			require.NoError(t, err)
			var line map[string]any
			require.NoError(t, json.Unmarshal(data, &line), "%s", data)
			assert.Equal(t, "exchange", line["msg"])
			assert.Equal(t, "OK", line["code"])
		})
	}
}

func TestParseFlagsGrantBytesPerCluster(t *testing.T) {
	required := requiredFlags(t)
	for _, tt := range []struct {
		name    string
		args    []string
		want    int
		wantErr string
	}{
		{name: "default", want: 32 << 20},
		{name: "set", args: []string{"--max-grant-bytes-per-cluster=67108864"}, want: 64 << 20},
		{name: "the largest grant", args: []string{"--max-grant-bytes-per-cluster=32768"}, want: 32 << 10},
		{name: "less than the largest grant", args: []string{"--max-grant-bytes-per-cluster=32767"},
			wantErr: "the grant bytes per cluster must be at least 32768, the largest grant an agent reports, got 32767"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cfg, _, err := parseFlags(append(append([]string{}, required...), tt.args...))
			if tt.wantErr != "" {
				require.Error(t, err)
				assert.Contains(t, err.Error(), tt.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, cfg.MaxGrantBytesPerCluster)
		})
	}
}
