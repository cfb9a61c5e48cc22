package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/credbroker/credbroker/test/framework"
)

// argoCDExample is deploy/examples/argocd-cluster-secret.yaml as a person
// fills it in for this environment: the spoke's server and CA, and the
// plugin's files; everything else is the file's.
func argoCDExample(t *testing.T, c consumer, server string, ca []byte) *framework.ArgoCDClusterConfig {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("..", "..", "deploy", "examples", "argocd-cluster-secret.yaml"))
	require.NoError(t, err)
	_, cfg, err := framework.ParseArgoCDClusterSecret(raw)
	require.NoError(t, err)
	tokenFile := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(c.token), 0o600))
	exec := cfg.ExecProviderConfig
	exec.Command = pluginBin
	for i, arg := range exec.Args {
		switch {
		case strings.HasPrefix(arg, "--broker-address="):
			exec.Args[i] = "--broker-address=" + deployment.Broker.ExchangeAddr()
		case strings.HasPrefix(arg, "--ca-file="):
			exec.Args[i] = "--ca-file=" + deployment.CAFile
		case strings.HasPrefix(arg, "--token-file="):
			exec.Args[i] = "--token-file=" + tokenFile
		}
	}
	cfg.TLSClientConfig.CAData = ca
	return cfg
}

// Argo CD v3.5 reaches a spoke through the example cluster Secret: the
// client that Argo CD builds for it (server, CA, and an exec provider with
// provideClusterInfo and the exec extension from execProviderConfig.config)
// lists namespaces through the shipped plugin, which takes the
// ClusterProfile from the extension and pins the Secret's server and CA.
func TestArgoCDClusterSecret(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	spoke := env.Spokes[0]
	require.Equal(t, "spoke-1", spoke.Name, "the example names fleet/spoke-1")
	c := newConsumer(t, "credbroker", spoke.Name)
	ns := optIn(t, spoke, "argocd-controller", c.username())
	require.NoError(t, spoke.Grant(ctx, "", framework.ServiceAccountSubject(ns, "argocd-controller"), []rbacv1.PolicyRule{listNS}))

	// list lists namespaces with the client Argo CD builds for cfg and
	// server, and returns what the plugin wrote on stderr, which client-go
	// passes to the process's own.
	list := func(t *testing.T, cfg *framework.ArgoCDClusterConfig, server string) (stderr string, err error) {
		exec := cfg.ExecProviderConfig
		stderrFile := filepath.Join(t.TempDir(), "stderr")
		exec.Args = append([]string{"-c", `exec "$0" "$@" 2>"$PLUGIN_STDERR"`, exec.Command}, exec.Args...)
		exec.Command = "/bin/sh"
		exec.Env = map[string]string{"PLUGIN_STDERR": stderrFile}
		rc, err := cfg.RESTConfig(server)
		require.NoError(t, err)
		client, err := kubernetes.NewForConfig(rc)
		require.NoError(t, err)
		_, err = client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
		out, _ := os.ReadFile(stderrFile)
		return string(out), err
	}

	t.Run("the example, filled in", func(t *testing.T) {
		stderr, err := list(t, argoCDExample(t, c, spoke.Server, spoke.CAData), spoke.Server)
		require.NoError(t, err, stderr)
	})
	other := env.Spokes[1]
	for _, tc := range []struct {
		name, server, refusal string
		change                func(*framework.ArgoCDClusterConfig)
	}{
		{"another server under the example's ClusterProfile is refused", other.Server, "refusing to hand its token to " + other.Server,
			func(cfg *framework.ArgoCDClusterConfig) { cfg.TLSClientConfig.CAData = other.CAData }},
		{"without provideClusterInfo, as before Argo CD v3.5, the plugin refuses", spoke.Server, "ExecCredential does not contain cluster information",
			func(cfg *framework.ArgoCDClusterConfig) { cfg.ExecProviderConfig.ProvideClusterInfo = false }},
		{"without config, the plugin knows no ClusterProfile", spoke.Server, "no ClusterProfile to get a token for",
			func(cfg *framework.ArgoCDClusterConfig) { cfg.ExecProviderConfig.Config = nil }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := argoCDExample(t, c, tc.server, spoke.CAData)
			tc.change(cfg)
			stderr, err := list(t, cfg, tc.server)
			require.Error(t, err)
			assert.Contains(t, stderr, tc.refusal)
		})
	}
}
