package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

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

// A person generates a kubeconfig with 'credbroker kubeconfig' and the real
// kubectl lists namespaces on the spoke through the real plugin binary; the
// kubeconfig holds no token, and a consumer without hub RBAC gets one line
// that says which Role to add.
func TestKubeconfigWithKubectl(t *testing.T) {
	ctx := context.Background()
	kubectl := kubectlBin(t)
	spoke := env.Spokes[0]
	c := newConsumer(t, "credbroker", spoke.Name)
	ns := optIn(t, spoke, "kubectl-reader", c.username())
	require.NoError(t, spoke.Grant(ctx, "", framework.ServiceAccountSubject(ns, "kubectl-reader"), []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"namespaces"}, Verbs: []string{"list"}},
	}))

	dir := t.TempDir()
	cli := filepath.Join(dir, "credbroker")
	require.NoError(t, framework.Build(ctx, dir, "credbroker"))
	tokenFile := filepath.Join(dir, "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(c.token), 0o600))
	kubeconfig := filepath.Join(dir, "spoke.kubeconfig")

	out, err := exec.Command(cli, "kubeconfig", "--cluster", framework.FleetNamespace+"/"+spoke.Name,
		"--broker-address", deployment.Broker.ExchangeAddr(), "--ca-file", deployment.CAFile, "--token-file", tokenFile,
		"--plugin-path", pluginBin, "-o", kubeconfig).CombinedOutput()
	require.NoError(t, err, "credbroker kubeconfig: %s", out)
	raw, err := os.ReadFile(kubeconfig)
	require.NoError(t, err)
	assert.NotContains(t, string(raw), "token:")
	assert.NotContains(t, string(raw), c.token)
	kc, err := clientcmd.Load(raw)
	require.NoError(t, err)
	assert.Equal(t, spoke.Config.Host, kc.Clusters[kc.Contexts[kc.CurrentContext].Cluster].Server)

	cmd := exec.Command(kubectl, "--kubeconfig", kubeconfig, "get", "namespaces", "-o", "name")
	cmd.Env = append(os.Environ(), "HOME="+dir) // no cache or config of the machine's
	out, err = cmd.CombinedOutput()
	require.NoError(t, err, "kubectl: %s", out)
	assert.Contains(t, string(out), "namespace/"+ns)

	// Without hub RBAC: one line that names the Role to add.
	stranger := newConsumer(t, "credbroker")
	strangerToken := filepath.Join(dir, "stranger")
	require.NoError(t, os.WriteFile(strangerToken, []byte(stranger.token), 0o600))
	out, err = exec.Command(cli, "kubeconfig", "--cluster", framework.FleetNamespace+"/"+spoke.Name,
		"--broker-address", deployment.Broker.ExchangeAddr(), "--ca-file", deployment.CAFile, "--token-file", strangerToken).CombinedOutput()
	require.Error(t, err)
	line := strings.TrimSuffix(string(out), "\n")
	assert.NotContains(t, line, "\n")
	assert.Contains(t, line, "permission denied: hub RBAC does not allow")
	assert.Contains(t, line, "grant it with a Role like deploy/examples/consumer-rbac.yaml")
	assert.NotContains(t, line, stranger.token)
}
