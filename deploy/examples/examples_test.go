package examples_test

import (
	"bytes"
	"encoding/json"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"sigs.k8s.io/yaml"

	"github.com/credbroker/credbroker/pkg/plugin"
	"github.com/credbroker/credbroker/test/framework"
)

// The Argo CD cluster Secret is a cluster Secret, its config holds only
// fields Argo CD knows, it runs credbroker-plugin with the plugin's flags,
// verifies the spoke, and holds no token or key.
func TestArgoCDClusterSecret(t *testing.T) {
	raw, err := os.ReadFile("argocd-cluster-secret.yaml")
	require.NoError(t, err)
	secret, cfg, err := framework.ParseArgoCDClusterSecret(raw)
	require.NoError(t, err)
	assert.Equal(t, "Secret", secret.Kind)
	assert.Equal(t, "cluster", secret.Labels["argocd.argoproj.io/secret-type"])
	assert.Empty(t, secret.Data, "stringData only")
	for _, key := range []string{"name", "server", "config"} {
		assert.NotEmpty(t, secret.StringData[key], key)
	}
	assert.True(t, strings.HasPrefix(secret.StringData["server"], "https://"))

	assert.Empty(t, cfg.BearerToken, "no token")
	assert.Empty(t, cfg.Username+cfg.Password, "no password")
	assert.Empty(t, cfg.TLSClientConfig.KeyData, "no client key")
	assert.Empty(t, cfg.TLSClientConfig.CertData, "no client certificate")
	assert.Nil(t, cfg.AWSAuthConfig)
	assert.False(t, cfg.TLSClientConfig.Insecure, "the spoke is verified")
	assert.NotEmpty(t, cfg.TLSClientConfig.CAData, "the spoke is verified with its CA")

	exec := cfg.ExecProviderConfig
	require.NotNil(t, exec)
	assert.Equal(t, "/opt/credbroker/credbroker-plugin", exec.Command, "where argocd-application-controller-patch.yaml mounts it")
	assert.Equal(t, "client.authentication.k8s.io/v1", exec.APIVersion)
	assert.NotEmpty(t, exec.InstallHint)
	args := strings.Join(exec.Args, " ")
	for _, flag := range []string{"--broker-address=", "--ca-file=", "--token-file="} {
		assert.Contains(t, args, flag)
	}
	// Argo CD v3.5: the plugin gets the server and CA to pin, and the
	// ClusterProfile from the exec extension; test/e2e
	// TestArgoCDClusterSecret runs the file.
	assert.True(t, exec.ProvideClusterInfo, "provideClusterInfo")
	require.NotNil(t, exec.Config)
	var ext plugin.ExecConfig
	require.NoError(t, json.Unmarshal(exec.Config.Raw, &ext))
	assert.Equal(t, &plugin.Reference{Namespace: "fleet", Name: "spoke-1"}, ext.ClusterProfile)
	for k, v := range exec.Env {
		assert.NotContains(t, strings.ToLower(k+v), "token=", "no token in the environment")
	}
	assert.False(t, bytes.Contains(raw, []byte("eyJ")), "no JWT anywhere in the file")
}

// The example spoke ServiceAccount opts in, and its RoleBindings give it
// only Roles of the file that read, and read no Secret: no built-in role
// such as edit, whose token could mint itself a token that no grant binds
// (test/e2e TestEditServiceAccountIsRefused), or start pods that outlive
// the grant.
func TestSpokeServiceAccountIsNarrow(t *testing.T) {
	raw, err := os.ReadFile("spoke-serviceaccount.yaml")
	require.NoError(t, err)
	roles := map[string][]rbacv1.PolicyRule{}
	var bindings []rbacv1.RoleBinding
	var sa *corev1.ServiceAccount
	for _, doc := range strings.Split(string(raw), "\n---\n") {
		var meta struct{ Kind string }
		require.NoError(t, yaml.Unmarshal([]byte(doc), &meta))
		switch meta.Kind {
		case "ServiceAccount":
			sa = &corev1.ServiceAccount{}
			require.NoError(t, yaml.UnmarshalStrict([]byte(doc), sa))
		case "Role":
			var r rbacv1.Role
			require.NoError(t, yaml.UnmarshalStrict([]byte(doc), &r))
			roles[r.Name] = r.Rules
		case "RoleBinding":
			var b rbacv1.RoleBinding
			require.NoError(t, yaml.UnmarshalStrict([]byte(doc), &b))
			bindings = append(bindings, b)
		case "Namespace":
		default:
			t.Errorf("unexpected %s in the example; a ClusterRoleBinding would reach beyond the namespace", meta.Kind)
		}
	}
	require.NotNil(t, sa)
	assert.NotEmpty(t, sa.Annotations["credbroker.io/allowed-subjects"])
	require.NotEmpty(t, bindings)
	for _, b := range bindings {
		assert.Equal(t, sa.Namespace, b.Namespace)
		assert.Equal(t, []rbacv1.Subject{{Kind: "ServiceAccount", Name: sa.Name, Namespace: sa.Namespace}}, b.Subjects)
		rules, ok := roles[b.RoleRef.Name]
		if !assert.True(t, ok && b.RoleRef.Kind == "Role", "RoleBinding %s binds %s %s, not a Role of the example", b.Name, b.RoleRef.Kind, b.RoleRef.Name) {
			continue
		}
		for _, r := range rules {
			for _, v := range r.Verbs {
				assert.Contains(t, []string{"get", "list", "watch"}, v, "Role %s lets the token %s %v", b.RoleRef.Name, v, r.Resources)
			}
			for _, res := range r.Resources {
				assert.NotContains(t, []string{"secrets", "*"}, res, "Role %s lets the token read %s", b.RoleRef.Name, res)
			}
			assert.NotContains(t, r.APIGroups, "*")
		}
	}
}
