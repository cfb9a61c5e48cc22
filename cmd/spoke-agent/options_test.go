package main

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/types"
)

// writeKubeconfig writes a kubeconfig of a spoke and returns its path.
func writeKubeconfig(t *testing.T) string {
	t.Helper()
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	require.NoError(t, os.WriteFile(kubeconfig, []byte(`apiVersion: v1
kind: Config
clusters: [{name: spoke, cluster: {server: "https://127.0.0.1:6443"}}]
contexts: [{name: spoke, context: {cluster: spoke, user: agent}}]
current-context: spoke
users: [{name: agent, user: {token: x}}]
`), 0o600))
	return kubeconfig
}

func TestParseFlagsCluster(t *testing.T) {
	kubeconfig := writeKubeconfig(t)
	required := []string{
		"--broker-address", "broker.example:8444", "--trust-domain", "fleet.example",
		"--svid-cert-file", "c", "--svid-key-file", "k", "--trust-bundle-file", "b", "--kubeconfig", kubeconfig,
	}
	tests := []struct {
		name    string
		cluster []string
		want    types.NamespacedName
		wantErr string
	}{
		{name: "not set", want: types.NamespacedName{}},
		{name: "set", cluster: []string{"--cluster", "fleet/east-1"}, want: types.NamespacedName{Namespace: "fleet", Name: "east-1"}},
		{name: "no slash", cluster: []string{"--cluster", "east-1"}, wantErr: `--cluster "east-1": want namespace/name`},
		{name: "no name", cluster: []string{"--cluster", "fleet/"}, wantErr: `--cluster "fleet/": want namespace/name`},
		{name: "too many parts", cluster: []string{"--cluster", "fleet/east/1"}, wantErr: `--cluster "fleet/east/1": want namespace/name`},
		{name: "not a name", cluster: []string{"--cluster", "Fleet/east_1"}, wantErr: `the cluster "Fleet/east_1" is not a ClusterProfile namespace/name`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := parseFlags(append(append([]string(nil), required...), tt.cluster...))
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, cfg.Cluster)
		})
	}
}

func TestParseFlagsSVIDSource(t *testing.T) {
	kubeconfig := writeKubeconfig(t)
	base := []string{"--broker-address", "broker.example:8444", "--trust-domain", "fleet.example", "--kubeconfig", kubeconfig}
	files := []string{"--svid-cert-file", "c", "--svid-key-file", "k", "--trust-bundle-file", "b"}
	socket := []string{"--spiffe-endpoint-socket", "unix:///run/spire/agent-sockets/spire-agent.sock"}
	tests := []struct {
		name    string
		args    []string
		wantID  string
		wantErr string
	}{
		{name: "files", args: files},
		{name: "socket", args: socket},
		{name: "socket and own ID", args: append(socket, "--spiffe-id", "spiffe://fleet.example/clusterprofile/fleet/east-1"),
			wantID: "spiffe://fleet.example/clusterprofile/fleet/east-1"},
		{name: "neither", wantErr: "an SVID source is required: the Workload API socket (--spiffe-endpoint-socket), " +
			"or an SVID certificate, key and trust bundle (--svid-cert-file, --svid-key-file, --trust-bundle-file)"},
		{name: "both", args: append(append([]string(nil), files...), socket...), wantErr: "set either the Workload API socket (--spiffe-endpoint-socket) " +
			"or the SVID files (--svid-cert-file, --svid-key-file, --trust-bundle-file), not both"},
		{name: "ID of another trust domain", args: append(socket, "--spiffe-id", "spiffe://other.example/x"),
			wantErr: "the agent's SPIFFE ID spiffe://other.example/x is not in trust domain"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := parseFlags(append(append([]string(nil), base...), tt.args...))
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			if tt.wantID != "" {
				assert.Equal(t, tt.wantID, cfg.SPIFFEID.String())
			}
		})
	}
}

func TestParseFlagsLimitsAndShutdown(t *testing.T) {
	kubeconfig := writeKubeconfig(t)
	required := []string{
		"--broker-address", "broker.example:8444", "--trust-domain", "fleet.example",
		"--svid-cert-file", "c", "--svid-key-file", "k", "--trust-bundle-file", "b", "--kubeconfig", kubeconfig,
	}
	tests := []struct {
		name         string
		args         []string
		wantInFlight int
		wantGrace    time.Duration
		wantMetrics  string
		wantErr      string
	}{
		{name: "defaults", wantInFlight: 64, wantGrace: 15 * time.Second, wantMetrics: ":8080"},
		{name: "set", args: []string{"--max-in-flight=8", "--shutdown-grace=25s", "--metrics-address="},
			wantInFlight: 8, wantGrace: 25 * time.Second},
		{name: "no in-flight requests", args: []string{"--max-in-flight=0"}, wantErr: "the in-flight requests per stream must be positive"},
		{name: "no grace", args: []string{"--shutdown-grace=0s"}, wantErr: "the shutdown grace must be positive"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := parseFlags(append(append([]string(nil), required...), tt.args...))
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.wantInFlight, cfg.MaxInFlight)
			assert.Equal(t, tt.wantGrace, cfg.ShutdownGrace)
			assert.Equal(t, tt.wantMetrics, cfg.MetricsAddress)
		})
	}
}

// client-go's default 5 QPS would throttle the agent: a mint costs three
// spoke requests, and a revoke one per grant.
func TestParseFlagsSpokeQPS(t *testing.T) {
	required := []string{
		"--broker-address", "broker.example:8444", "--trust-domain", "fleet.example",
		"--svid-cert-file", "c", "--svid-key-file", "k", "--trust-bundle-file", "b", "--kubeconfig", writeKubeconfig(t),
	}
	tests := []struct {
		name      string
		args      []string
		wantQPS   float32
		wantBurst int
		wantErr   string
	}{
		{name: "defaults", wantQPS: 50, wantBurst: 100},
		{name: "set", args: []string{"--spoke-qps", "20.5", "--spoke-burst", "40"}, wantQPS: 20.5, wantBurst: 40},
		{name: "not a number", args: []string{"--spoke-qps", "50abc"}, wantErr: "not a finite number"},
		{name: "infinite", args: []string{"--spoke-qps", "Inf"}, wantErr: "not a finite number"},
		{name: "zero burst", args: []string{"--spoke-burst", "0"}, wantErr: "spoke QPS and burst must be positive"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := parseFlags(append(slices.Clone(required), tt.args...))
			if tt.wantErr != "" {
				require.Error(t, err)
				assert.Contains(t, err.Error(), tt.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.wantQPS, cfg.SpokeQPS)
			assert.Equal(t, tt.wantBurst, cfg.SpokeBurst)
		})
	}
}

func TestParseFlagsLogs(t *testing.T) {
	required := []string{
		"--broker-address", "broker.example:8444", "--trust-domain", "fleet.example",
		"--svid-cert-file", "c", "--svid-key-file", "k", "--trust-bundle-file", "b", "--kubeconfig", writeKubeconfig(t),
	}
	tests := []struct {
		name    string
		args    []string
		wantErr string
	}{
		{name: "defaults"},
		{name: "json and verbosity", args: []string{"--log-format=json", "-v", "3"}},
		{name: "text and long verbosity", args: []string{"--log-format", "text", "--v=2"}},
		{name: "single-dash long flags still work", args: []string{"-log-format=json", "-max-in-flight", "4"}},
		{name: "bad format", args: []string{"--log-format=yaml"}, wantErr: `--log-format "yaml": want "text" or "json"`},
		{name: "no audit log on the agent", args: []string{"--audit-log-path=-"}, wantErr: "unknown flag: --audit-log-path"},
		{name: "short verbosity with =", args: []string{"-v=2"}},
		{name: "version", args: []string{"--version"}, wantErr: "version requested"},
		{name: "verbosity and version", args: []string{"-v=2", "--version"}, wantErr: "version requested"},
		{name: "positional", args: []string{"extra"}, wantErr: `unexpected arguments ["extra"]`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := parseFlags(append(slices.Clone(required), tt.args...))
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			assert.NotNil(t, cfg.Log.GetSink())
		})
	}
}

func TestParseFlagsAllowEscalating(t *testing.T) {
	kubeconfig := writeKubeconfig(t)
	required := []string{
		"--broker-address", "broker.example:8444", "--trust-domain", "fleet.example",
		"--svid-cert-file", "c", "--svid-key-file", "k", "--trust-bundle-file", "b", "--kubeconfig", kubeconfig,
	}
	tests := []struct {
		name    string
		args    []string
		want    []types.NamespacedName
		wantErr string
	}{
		{name: "default: none"},
		{name: "one", args: []string{"--allow-escalating-service-accounts=apps/deployer"},
			want: []types.NamespacedName{{Namespace: "apps", Name: "deployer"}}},
		{name: "comma-separated and repeated", args: []string{"--allow-escalating-service-accounts=apps/deployer, ci/*", "--allow-escalating-service-accounts", "ops/backup"},
			want: []types.NamespacedName{{Namespace: "apps", Name: "deployer"}, {Namespace: "ci", Name: "*"}, {Namespace: "ops", Name: "backup"}}},
		{name: "no namespace", args: []string{"--allow-escalating-service-accounts=deployer"},
			wantErr: `--allow-escalating-service-accounts: "deployer": want namespace/name or namespace/*`},
		{name: "every namespace", args: []string{"--allow-escalating-service-accounts=*/*"},
			wantErr: `--allow-escalating-service-accounts: allowed escalating ServiceAccount "*/*": namespace "*"`},
		{name: "a pattern", args: []string{"--allow-escalating-service-accounts=apps/deploy*"},
			wantErr: `name "deploy*" is neither a ServiceAccount name nor *`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := parseFlags(append(append([]string(nil), required...), tt.args...))
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, cfg.AllowEscalatingServiceAccounts)
		})
	}
}
