package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/credbroker/credbroker/test/framework"
)

// kubectlBin is the kubectl the kubeconfig test runs: the one that
// hack/testbin.sh builds into $KUBEBUILDER_ASSETS, of the API servers'
// version, never one from PATH.
func kubectlBin(t *testing.T) string {
	t.Helper()
	k, err := framework.Kubectl()
	require.NoError(t, err)
	return k
}

// kubeconfigFor runs 'credbroker kubeconfig' (built into dir) for the
// ClusterProfile fleet/cluster as c, and returns the kubeconfig's path and
// the server it names; the kubeconfig holds no token.
func kubeconfigFor(t *testing.T, dir string, c consumer, cluster string) (path, server string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cli := filepath.Join(dir, "credbroker")
	if _, err := os.Stat(cli); err != nil {
		require.NoError(t, framework.Build(ctx, dir, "credbroker"))
	}
	tokenFile := filepath.Join(dir, "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(c.token), 0o600))
	path = filepath.Join(dir, cluster+".kubeconfig")
	out, err := exec.CommandContext(ctx, cli, "kubeconfig", "--cluster", framework.FleetNamespace+"/"+cluster,
		"--broker-address", deployment.Broker.ExchangeAddr(), "--ca-file", deployment.CAFile, "--token-file", tokenFile,
		"--plugin-path", pluginBin, "-o", path).CombinedOutput()
	require.NoError(t, err, "credbroker kubeconfig: %s", out)
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	assert.NotContains(t, string(raw), "token:")
	assert.NotContains(t, string(raw), c.token)
	kc, err := clientcmd.Load(raw)
	require.NoError(t, err)
	return path, kc.Clusters[kc.Contexts[kc.CurrentContext].Cluster].Server
}

// kubectlGetNamespaces runs the real kubectl with kubeconfig, and no cache
// or configuration of the machine's, and returns what it printed.
func kubectlGetNamespaces(t *testing.T, dir, kubeconfig string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, kubectlBin(t), "--kubeconfig", kubeconfig, "get", "namespaces", "-o", "name")
	cmd.Env = append(os.Environ(), "HOME="+dir)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "kubectl: %s", out)
	return string(out)
}

// A person generates a kubeconfig with 'credbroker kubeconfig' and the real
// kubectl lists namespaces on the spoke through the real plugin binary; the
// kubeconfig holds no token, and a consumer without hub RBAC gets one line
// that says which Role to add.
func TestKubeconfigWithKubectl(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	c := newConsumer(t, "credbroker", spoke.Name)
	ns := optIn(t, spoke, "kubectl-reader", c.username())
	require.NoError(t, spoke.Grant(ctx, "", framework.ServiceAccountSubject(ns, "kubectl-reader"), []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"namespaces"}, Verbs: []string{"list"}},
	}))

	dir := t.TempDir()
	kubeconfig, server := kubeconfigFor(t, dir, c, spoke.Name)
	assert.Equal(t, spoke.Config.Host, server)
	assert.Contains(t, kubectlGetNamespaces(t, dir, kubeconfig), "namespace/"+ns)
	cli := filepath.Join(dir, "credbroker")

	// Without hub RBAC: one line that names the Role to add.
	stranger := newConsumer(t, "credbroker")
	strangerToken := filepath.Join(dir, "stranger")
	require.NoError(t, os.WriteFile(strangerToken, []byte(stranger.token), 0o600))
	out, err := exec.Command(cli, "kubeconfig", "--cluster", framework.FleetNamespace+"/"+spoke.Name,
		"--broker-address", deployment.Broker.ExchangeAddr(), "--ca-file", deployment.CAFile, "--token-file", strangerToken).CombinedOutput()
	require.Error(t, err)
	line := strings.TrimSuffix(string(out), "\n")
	assert.NotContains(t, line, "\n")
	assert.Contains(t, line, "permission denied: hub RBAC does not allow")
	assert.Contains(t, line, "grant it with a Role like deploy/examples/consumer-rbac.yaml")
	assert.NotContains(t, line, stranger.token)
}

// kubectl reaches a spoke the hub cannot route to with nothing new: the
// kubeconfig that 'credbroker kubeconfig' writes names the broker's API
// proxy, as the exchange answers it, and the plugin's pin holds.
func TestKubectlThroughTheDataPath(t *testing.T) {
	spoke := env.Spokes[1]
	name, server := dataPathProfile(t, spoke, "datapath-kubectl")
	c := newConsumer(t, "credbroker", name)
	ns := optIn(t, spoke, "kubectl-reader", c.username())
	require.NoError(t, spoke.Grant(t.Context(), "", framework.ServiceAccountSubject(ns, "kubectl-reader"), []rbacv1.PolicyRule{listNS}))

	dir := t.TempDir()
	kubeconfig, got := kubeconfigFor(t, dir, c, name)
	assert.Equal(t, server, got, "the kubeconfig names the proxy")
	assert.Contains(t, kubectlGetNamespaces(t, dir, kubeconfig), "namespace/"+ns)
}
