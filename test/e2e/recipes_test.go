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
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/credbroker/credbroker/test/framework"
)

// readRecipe returns docs/recipes/name.
func readRecipe(t *testing.T, name string) string {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("..", "..", "docs", "recipes", name))
	require.NoError(t, err)
	return string(raw)
}

// fencedBlocks returns the bodies of doc's ``` blocks of language lang.
func fencedBlocks(doc, lang string) []string {
	var blocks []string
	var body strings.Builder
	in := false
	for _, line := range strings.Split(doc, "\n") {
		switch {
		case !in && line == "```"+lang:
			in = true
			body.Reset()
		case in && line == "```":
			in = false
			blocks = append(blocks, body.String())
		case in:
			body.WriteString(line + "\n")
		}
	}
	return blocks
}

// recipeCommand returns, split into words, the first line of doc that
// starts with prefix, with the lines it continues with a trailing
// backslash.
func recipeCommand(t *testing.T, doc, prefix string) []string {
	t.Helper()
	lines := strings.Split(doc, "\n")
	for i, line := range lines {
		if !strings.HasPrefix(line, prefix) {
			continue
		}
		for j := i + 1; strings.HasSuffix(line, `\`) && j < len(lines); j++ {
			line = strings.TrimSuffix(line, `\`) + " " + strings.TrimSpace(lines[j])
		}
		return strings.Fields(line)
	}
	t.Fatalf("the recipe has no line that starts with %q", prefix)
	return nil
}

// setFlags replaces the values of the flags in values, given as --name=v or
// as --name v, and fails unless args gives every one of them.
func setFlags(t *testing.T, args []string, values map[string]string) []string {
	t.Helper()
	out := append([]string(nil), args...)
	seen := map[string]bool{}
	for i := 0; i < len(out); i++ {
		name, _, inline := strings.Cut(out[i], "=")
		v, ok := values[name]
		if !ok {
			continue
		}
		seen[name] = true
		if inline {
			out[i] = name + "=" + v
			continue
		}
		require.Less(t, i+1, len(out), "%s has no value", name)
		i++
		out[i] = v
	}
	for name := range values {
		assert.True(t, seen[name], "the recipe's command does not set %s: %q", name, args)
	}
	return out
}

// hubController creates, unless it exists, the hub ServiceAccount
// namespace/name that a tool's controller runs as, lets it ask for the
// given ClusterProfiles of the fleet, and mints it a hub token for the
// broker's audience, as the controller's projected volume would.
func hubController(t *testing.T, namespace, name string, fleetProfiles ...string) consumer {
	t.Helper()
	ctx := context.Background()
	if _, err := env.Hub.CreateServiceAccount(ctx, namespace, name, nil); !apierrors.IsAlreadyExists(err) {
		require.NoError(t, err)
	}
	for _, cp := range fleetProfiles {
		require.NoError(t, env.Hub.GrantClusterProfileToken(ctx, framework.FleetNamespace, cp, namespace, name))
	}
	tok, err := env.Hub.Token(ctx, namespace, name, []string{"credbroker"}, time.Hour)
	require.NoError(t, err)
	return consumer{namespace: namespace, name: name, token: tok}
}

// optInUntilCleanup is optIn, with the opt-in withdrawn when the test
// ends, so that a later run for the same fixed hub subject finds one opted
// in ServiceAccount, not two.
func optInUntilCleanup(t *testing.T, spoke *framework.Cluster, name, allowed string) string {
	t.Helper()
	ns := optIn(t, spoke, name, allowed)
	require.NoError(t, spoke.Grant(context.Background(), "", framework.ServiceAccountSubject(ns, name), []rbacv1.PolicyRule{listNS}))
	t.Cleanup(func() {
		ctx := context.Background()
		sa, err := spoke.Client.CoreV1().ServiceAccounts(ns).Get(ctx, name, metav1.GetOptions{})
		if assert.NoError(t, err) {
			delete(sa.Annotations, "credbroker.io/allowed-subjects")
			_, err = spoke.Client.CoreV1().ServiceAccounts(ns).Update(ctx, sa, metav1.UpdateOptions{})
			assert.NoError(t, err)
		}
	})
	return ns
}

// listNamespaces lists the namespaces of the cluster cfg reaches.
func listNamespaces(ctx context.Context, t *testing.T, cfg *rest.Config) ([]string, error) {
	t.Helper()
	client, err := kubernetes.NewForConfig(cfg)
	require.NoError(t, err)
	list, err := client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	var names []string
	for _, ns := range list.Items {
		names = append(names, ns.Name)
	}
	return names, nil
}

// Flux reaches a spoke through the kubeconfig Secret of docs/recipes/flux.md:
// the recipe's 'credbroker kubeconfig' line, run with the shipped binary
// (the test's broker address and files in place of the controller's),
// writes a kubeconfig that the recipe's 'kubectl create secret' line puts
// under its key in a Secret on the hub; read back as kustomize-controller and
// helm-controller read it, it lists the spoke's namespaces through the
// shipped plugin with --insecure-kubeconfig-exec, under "value" and
// "value.yaml", and without that flag Flux drops the exec and the spoke
// refuses the request.
func TestFluxKubeconfigSecret(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	doc := readRecipe(t, "flux.md")
	kubeconfigCmd := recipeCommand(t, doc, "credbroker kubeconfig ")
	secretCmd := recipeCommand(t, doc, "kubectl -n apps create secret generic ")

	// The cluster the recipe names is one of the test's.
	var cluster string
	for i, arg := range kubeconfigCmd {
		if arg == "--cluster" && i+1 < len(kubeconfigCmd) {
			cluster = kubeconfigCmd[i+1]
		}
	}
	require.Equal(t, framework.FleetNamespace+"/"+env.Spokes[0].Name, cluster, "the recipe's --cluster")
	spoke := env.Spokes[0]

	c := hubController(t, "flux-system", "kustomize-controller", spoke.Name)
	ns := optInUntilCleanup(t, spoke, "flux-deployer", c.username())

	// The controller's files: its projected hub token and the broker's CA.
	dir := t.TempDir()
	require.NoError(t, framework.Build(ctx, dir, "credbroker"))
	tokenFile := filepath.Join(dir, "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(c.token), 0o600))
	var docOutput string
	for i, arg := range kubeconfigCmd {
		if arg == "--output" && i+1 < len(kubeconfigCmd) {
			docOutput = kubeconfigCmd[i+1]
		}
	}
	require.NotEmpty(t, docOutput, "the recipe's --output")
	output := filepath.Join(dir, docOutput)
	args := setFlags(t, kubeconfigCmd[1:], map[string]string{
		"--broker-address": deployment.Broker.ExchangeAddr(),
		"--ca-file":        deployment.CAFile,
		"--token-file":     tokenFile,
		"--plugin-path":    pluginBin,
		"--output":         output,
	})
	out, err := exec.CommandContext(ctx, filepath.Join(dir, "credbroker"), args...).CombinedOutput()
	require.NoError(t, err, "credbroker %s: %s", strings.Join(args, " "), out)
	kubeconfig, err := os.ReadFile(output)
	require.NoError(t, err)
	assert.NotContains(t, string(kubeconfig), c.token)

	// kubectl create secret generic NAME --from-file=KEY=FILE.
	var secretName, key string
	for i, arg := range secretCmd {
		if arg == "generic" && i+1 < len(secretCmd) {
			secretName = secretCmd[i+1]
		}
		if from, ok := strings.CutPrefix(arg, "--from-file="); ok {
			var file string
			key, file, _ = strings.Cut(from, "=")
			assert.Equal(t, docOutput, file, "the Secret holds the kubeconfig the recipe wrote")
		}
	}
	require.NotEmpty(t, secretName, "the recipe's Secret name")
	require.Contains(t, []string{"value", "value.yaml"}, key, "Flux reads the key value, else value.yaml")

	// The Secret on the hub, in the namespace of the Kustomizations, read
	// back as Flux reads it.
	secretNS := uniqueName(t, "flux-apps")
	require.NoError(t, env.Hub.EnsureNamespace(ctx, secretNS))
	fluxConfig := func(t *testing.T, key string, opts framework.FluxKubeConfigOptions) *rest.Config {
		name := secretName + "-" + strings.ReplaceAll(key, ".", "-")
		_, err := env.Hub.Client.CoreV1().Secrets(secretNS).Create(ctx, &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Namespace: secretNS, Name: name},
			Data:       map[string][]byte{key: kubeconfig},
		}, metav1.CreateOptions{})
		if !apierrors.IsAlreadyExists(err) {
			require.NoError(t, err)
		}
		secret, err := env.Hub.Client.CoreV1().Secrets(secretNS).Get(ctx, name, metav1.GetOptions{})
		require.NoError(t, err)
		cfg, err := framework.FluxRESTConfig(secret, "", opts)
		require.NoError(t, err)
		return cfg
	}

	for _, k := range []string{key, "value.yaml"} {
		t.Run("with --insecure-kubeconfig-exec, under "+k, func(t *testing.T) {
			cfg := fluxConfig(t, k, framework.FluxKubeConfigOptions{InsecureExecProvider: true})
			require.NotNil(t, cfg.ExecProvider)
			assert.Empty(t, cfg.BearerToken, "no token in the Secret")
			names, err := listNamespaces(ctx, t, cfg)
			require.NoError(t, err)
			assert.Contains(t, names, ns)
		})
	}
	t.Run("without --insecure-kubeconfig-exec the spoke refuses", func(t *testing.T) {
		cfg := fluxConfig(t, key, framework.FluxKubeConfigOptions{})
		assert.Nil(t, cfg.ExecProvider, "Flux drops user.exec")
		_, err := listNamespaces(ctx, t, cfg)
		require.Error(t, err)
		assert.True(t, apierrors.IsUnauthorized(err) || apierrors.IsForbidden(err), "%v", err)
	})
}

// kueueTestdata returns test/e2e/testdata/name, and checks that
// docs/recipes/kueue.md quotes it unchanged as a YAML block.
func kueueTestdata(t *testing.T, doc, name string) []byte {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("testdata", name))
	require.NoError(t, err)
	assert.Contains(t, fencedBlocks(doc, "yaml"), string(raw), "docs/recipes/kueue.md must quote testdata/%s unchanged", name)
	return raw
}

// Kueue's MultiKueue reaches a worker through its ClusterProfile in
// kueue-system, with the Configuration, the Role and the MultiKueueCluster
// that docs/recipes/kueue.md quotes from testdata: the Configuration and
// the MultiKueueCluster parse strictly into mirrors of the fields Kueue
// reads and pass Kueue's checks; the Role, applied to the hub as it is,
// authorizes the exchange of kueue-system/kueue-controller-manager; and the
// client Kueue builds (the ClusterProfile from Kueue's namespace, pkg/access,
// Kueue's checks of the result) lists the worker's namespaces through the
// shipped plugin, served by an agent of kueue-system/worker-1.
func TestKueueMultiKueueClusterProfile(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	doc := readRecipe(t, "kueue.md")
	kcfg, err := framework.ParseKueueConfiguration(kueueTestdata(t, doc, "kueue-multikueue-config.yaml"))
	require.NoError(t, err)
	mkc, err := framework.ParseKueueMultiKueueCluster(kueueTestdata(t, doc, "kueue-multikueue-cluster.yaml"))
	require.NoError(t, err)
	rbac, err := framework.DecodeManifests(kueueTestdata(t, doc, "kueue-hub-rbac.yaml"))
	require.NoError(t, err)
	namespace, name := kcfg.ClusterProfileNamespace(), mkc.Spec.ClusterSource.ClusterProfileRef.Name
	require.Equal(t, "kueue-system", namespace)

	// The Role names the MultiKueueCluster's ClusterProfile, in Kueue's
	// namespace, for the ServiceAccount its RoleBinding binds.
	var subject rbacv1.Subject
	for _, o := range rbac {
		assert.Equal(t, namespace, o.GetNamespace(), "%s %s", o.GetKind(), o.GetName())
		switch o.GetKind() {
		case "Role":
			rules, _, _ := unstructured.NestedSlice(o.Object, "rules")
			require.Len(t, rules, 1)
			names, _, _ := unstructured.NestedStringSlice(rules[0].(map[string]any), "resourceNames")
			assert.Equal(t, []string{name}, names)
		case "RoleBinding":
			subjects, _, _ := unstructured.NestedSlice(o.Object, "subjects")
			require.Len(t, subjects, 1)
			s := subjects[0].(map[string]any)
			subject = framework.ServiceAccountSubject(s["namespace"].(string), s["name"].(string))
		}
	}
	require.Equal(t, framework.ServiceAccountSubject("kueue-system", "kueue-controller-manager"), subject)

	// The worker's ClusterProfile in Kueue's namespace, and an agent that
	// serves it.
	spoke := env.Spokes[0]
	_, err = env.Hub.CreateClusterProfile(ctx, namespace, name, deployment.ProfileAccess(spoke, namespace, name))
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = env.Hub.Inventory.ApisV1alpha1().ClusterProfiles(namespace).Delete(context.Background(), name, metav1.DeleteOptions{})
	})
	stop, err := deployment.StartAgentWith(ctx, spoke, framework.AgentOptions{
		ID:      "spiffe://" + framework.TrustDomain + "/clusterprofile/" + namespace + "/" + name,
		Cluster: namespace + "/" + name,
	})
	require.NoError(t, err)
	t.Cleanup(stop)

	// Kueue's ServiceAccount on the hub, with the recipe's Role as it is.
	c := hubController(t, subject.Namespace, subject.Name)
	require.NoError(t, env.Hub.Apply(ctx, rbac))
	require.NoError(t, wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		return env.Hub.Allowed(ctx, subject, authorizationv1.ResourceAttributes{
			Namespace: namespace, Verb: "create", Group: "multicluster.x-k8s.io",
			Resource: "clusterprofiles", Subresource: "token", Name: name,
		})
	}), "the recipe's Role does not let %s ask for %s/%s", c.username(), namespace, name)

	// The worker's opt-in, as multikueue-sa.
	workerNS := optInUntilCleanup(t, spoke, "multikueue-sa", c.username())

	// Kueue's provider entries, with the test's files in place of the pod's.
	tokenFile := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(c.token), 0o600))
	providers := kcfg.MultiKueue.ClusterProfile.AccessProviders
	require.Len(t, providers, 1)
	providers[0].ExecConfig.Command = pluginBin
	providers[0].ExecConfig.Args = setFlags(t, providers[0].ExecConfig.Args, map[string]string{
		"--broker-address": deployment.Broker.ExchangeAddr(),
		"--ca-file":        deployment.CAFile,
		"--token-file":     tokenFile,
	})

	cfg, err := framework.KueueRESTConfig(ctx, env.Hub.Inventory, kcfg, mkc)
	require.NoError(t, err)
	require.NotNil(t, cfg.ExecProvider)
	assert.Equal(t, spoke.Server, cfg.Host)
	names, err := listNamespaces(ctx, t, cfg)
	require.NoError(t, err)
	assert.Contains(t, names, workerNS)
}
