package deploy_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"

	"github.com/credbroker/credbroker/test/framework"
)

const (
	hub   = "hub"
	spoke = "spoke"
)

// components says which bases each directory of deploy/components is for.
// A component missing here fails TestEveryKustomizationIsRendered.
var components = map[string][]string{
	"agent-node-selector":     {spoke},
	"control-plane-healthy":   {hub},
	"csi-driver-spiffe":       {hub, spoke},
	"publish-access-provider": {hub},
	"spiffe-helper":           {hub, spoke},
	"spire":                   {hub, spoke},
}

// bases are the kustomizations under deploy/ that are not components, and
// the cluster they install into.
var bases = map[string]string{
	"hub":              hub,
	"spoke":            spoke,
	"monitoring":       hub,
	"monitoring/spoke": spoke,
}

// skippedGroups are API groups whose objects the test API servers cannot
// take, and why.
var skippedGroups = map[string]string{
	"monitoring.coreos.com": "the Prometheus Operator's CRDs (ServiceMonitor, PrometheusRule) are not installed on the test API servers",
}

// thirdPartyImages are the only images in deploy/ that credbroker does not
// build; pin each to a release.
var thirdPartyImages = map[string]bool{
	"ghcr.io/spiffe/spiffe-helper:0.10.0": true,
}

var (
	envOnce sync.Once
	env     *framework.Env
	envErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if env != nil {
		if err := env.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "stop the test API servers:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// assets skips the test when KUBEBUILDER_ASSETS is unset, as the other
// envtest tests do, and returns the folder.
func assets(t *testing.T) string {
	t.Helper()
	dir := os.Getenv(framework.AssetsEnv)
	if dir == "" {
		t.Skip(framework.AssetsEnv + " is unset: run make test")
	}
	return dir
}

// clusters starts, once per package, a hub (with the ClusterProfile CRD)
// and one spoke.
func clusters(t *testing.T) *framework.Env {
	t.Helper()
	assets(t)
	envOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		env, envErr = framework.Start(ctx, framework.Options{Spokes: 1})
	})
	require.NoError(t, envErr)
	return env
}

// deployDir is the absolute path of deploy/.
func deployDir(t *testing.T) string {
	t.Helper()
	dir, err := filepath.Abs(".")
	require.NoError(t, err)
	return dir
}

// target is one kustomization to render and the cluster it installs into.
type target struct {
	name    string
	cluster string
	dir     string
}

// overlay writes a throwaway kustomization into a temporary folder that
// includes base (a directory under deploy/) and the components, plus extra
// kustomization fields; files are copied next to it.
func overlay(t *testing.T, base string, comps []string, extra string, files ...string) string {
	t.Helper()
	dir := t.TempDir()
	rel := func(p string) string {
		r, err := filepath.Rel(dir, filepath.Join(deployDir(t), p))
		require.NoError(t, err)
		return r
	}
	var b strings.Builder
	b.WriteString("apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n")
	fmt.Fprintf(&b, "  - %s\n", rel(base))
	if len(comps) > 0 {
		b.WriteString("components:\n")
		for _, c := range comps {
			fmt.Fprintf(&b, "  - %s\n", rel(filepath.Join("components", c)))
		}
	}
	b.WriteString(extra)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(b.String()), 0o600))
	for _, f := range files {
		raw, err := os.ReadFile(f)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(dir, filepath.Base(f)), raw, 0o600))
	}
	return dir
}

// renamedSpoke is an overlay that moves and renames the agent, as the
// csi-driver-spiffe instructions do (a nameSuffix per spoke).
const renamedNamespace, renamedSuffix = "credbroker-renamed", "-spoke-9"

// targets lists every base, every component on each base it is for, and
// the overlays the docs describe.
func targets(t *testing.T) []target {
	t.Helper()
	var out []target
	for _, name := range sortedKeys(bases) {
		_, err := os.Stat(filepath.Join(name, "kustomization.yaml"))
		require.NoError(t, err)
		out = append(out, target{name: name, cluster: bases[name], dir: name})
	}
	for _, comp := range sortedKeys(components) {
		for _, base := range components[comp] {
			out = append(out, target{name: base + "+" + comp, cluster: base, dir: overlay(t, base, []string{comp}, "")})
		}
	}
	out = append(out,
		target{name: "hub+examples/broker-networkpolicy-patch", cluster: hub, dir: overlay(t, "hub", nil,
			"patches:\n  - path: broker-networkpolicy-patch.yaml\n    target: {group: networking.k8s.io, kind: NetworkPolicy, name: broker}\n",
			filepath.Join("examples", "broker-networkpolicy-patch.yaml"))},
		target{name: "spoke renamed (namespace " + renamedNamespace + ", nameSuffix " + renamedSuffix + ")", cluster: spoke,
			dir: overlay(t, "spoke", nil, "namespace: "+renamedNamespace+"\nnameSuffix: "+renamedSuffix+"\n")},
	)
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// kustomize renders dir with "$KUBEBUILDER_ASSETS/kubectl kustomize".
func kustomize(t *testing.T, dir string) []*unstructured.Unstructured {
	t.Helper()
	assets(t) // skips without KUBEBUILDER_ASSETS
	objs, err := framework.Kustomize(t.Context(), dir)
	require.NoError(t, err, "kubectl is built by hack/testbin.sh (make testbin)")
	return objs
}

func describe(o *unstructured.Unstructured) string {
	if ns := o.GetNamespace(); ns != "" {
		return o.GetKind() + " " + ns + "/" + o.GetName()
	}
	return o.GetKind() + " " + o.GetName()
}

// Every kustomization under deploy/ is a base or a component that
// targets() renders.
func TestEveryKustomizationIsRendered(t *testing.T) {
	assets(t)
	err := filepath.WalkDir(".", func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || d.Name() != "kustomization.yaml" {
			return err
		}
		dir := filepath.Dir(path)
		if comp, ok := strings.CutPrefix(dir, "components"+string(filepath.Separator)); ok {
			assert.Contains(t, components, comp, "%s: say which bases this component is for in components", dir)
			return nil
		}
		assert.Contains(t, bases, dir, "%s: say which cluster this kustomization installs into in bases", dir)
		return nil
	})
	require.NoError(t, err)
}

// Every rendered object is accepted by a real API server with server-side
// dry-run; namespaces and ServiceAccounts are created for real first.
// The pods of every workload are admitted too (Pod Security of the
// namespace), as dry-run Pods.
func TestServerSideDryRun(t *testing.T) {
	e := clusters(t)
	clients := map[string]*applier{hub: newApplier(t, e.Hub), spoke: newApplier(t, e.Spokes[0])}
	var summary []string
	for _, tg := range targets(t) {
		t.Run(tg.name, func(t *testing.T) {
			objs := kustomize(t, tg.dir)
			accepted := clients[tg.cluster].applyAll(t, objs)
			t.Logf("%s (%s): server-side dry-run accepted %d objects:\n  %s", tg.name, tg.cluster, len(accepted), strings.Join(accepted, "\n  "))
			summary = append(summary, fmt.Sprintf("%s -> %s: %s", tg.name, tg.cluster, strings.Join(accepted, ", ")))
		})
	}
	t.Logf("accepted per render:\n%s", strings.Join(summary, "\n"))
}

type applier struct {
	cluster  *framework.Cluster
	dyn      dynamic.Interface
	mapper   meta.ResettableRESTMapper
	warnings *warnings
}

type warnings struct {
	mu   sync.Mutex
	list []string
}

func (w *warnings) HandleWarningHeader(_ int, _ string, text string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.list = append(w.list, text)
}

func (w *warnings) take() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := w.list
	w.list = nil
	return out
}

func newApplier(t *testing.T, c *framework.Cluster) *applier {
	t.Helper()
	w := &warnings{}
	cfg := rest.CopyConfig(c.Config)
	cfg.WarningHandler = w
	dc, err := discovery.NewDiscoveryClientForConfig(cfg)
	require.NoError(t, err)
	return &applier{
		cluster:  c,
		dyn:      dynamic.NewForConfigOrDie(cfg),
		mapper:   restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc)),
		warnings: w,
	}
}

// applyAll applies objs and returns a line per accepted object. Any API
// warning (such as "would violate PodSecurity") fails the test.
func (a *applier) applyAll(t *testing.T, objs []*unstructured.Unstructured) []string {
	t.Helper()
	ctx := context.Background()
	var accepted []string
	// Namespaces first, for real: a namespaced dry-run fails in a namespace
	// that does not exist. ServiceAccounts too: the admission policies take
	// the agent's as their parameter.
	for _, real := range []string{"Namespace", "ServiceAccount"} {
		for _, o := range objs {
			if o.GetKind() == real {
				_, err := a.apply(ctx, o, false)
				require.NoError(t, err, "create %s", describe(o))
			}
		}
	}
	for _, o := range objs {
		if reason, ok := skippedGroups[o.GroupVersionKind().Group]; ok {
			t.Logf("skipped %s: %s", describe(o), reason)
			continue
		}
		scope, err := a.apply(ctx, o, true)
		if !assert.NoError(t, err, "server-side dry-run of %s", describe(o)) {
			continue
		}
		line := describe(o)
		if scope == meta.RESTScopeNameRoot && o.GetNamespace() != "" {
			line += " (cluster-scoped: the server drops the namespace kustomize set)"
		}
		accepted = append(accepted, line)
		if tmpl, ok, _ := unstructured.NestedMap(o.Object, "spec", "template"); ok && o.GroupVersionKind().Group == "apps" {
			pod := &unstructured.Unstructured{Object: map[string]any{"apiVersion": "v1", "kind": "Pod"}}
			pod.Object["metadata"] = tmpl["metadata"]
			pod.Object["spec"] = tmpl["spec"]
			pod.SetName("dry-run-" + strings.ToLower(o.GetKind()) + "-" + o.GetName())
			pod.SetNamespace(o.GetNamespace())
			_, err := a.apply(ctx, pod, true)
			if assert.NoError(t, err, "a pod of %s is refused", describe(o)) {
				accepted = append(accepted, "Pod of "+describe(o)+" (Pod Security admitted)")
			}
		}
		for _, w := range a.warnings.take() {
			t.Errorf("%s: warning from the API server: %s", describe(o), w)
		}
	}
	return accepted
}

// apply server-side applies o, as a dry run or for real, at the scope the
// API server gives its kind.
func (a *applier) apply(ctx context.Context, o *unstructured.Unstructured, dryRun bool) (meta.RESTScopeName, error) {
	gvk := o.GroupVersionKind()
	m, err := a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		a.mapper.Reset()
		if m, err = a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version); err != nil {
			return "", fmt.Errorf("%s is not served: %w", gvk, err)
		}
	}
	opts := metav1.ApplyOptions{FieldManager: "credbroker-deploy-test", Force: true}
	if dryRun {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	var r dynamic.ResourceInterface = a.dyn.Resource(m.Resource)
	if m.Scope.Name() == meta.RESTScopeNameNamespace {
		if o.GetNamespace() == "" {
			return "", fmt.Errorf("namespaced %s has no namespace", describe(o))
		}
		r = a.dyn.Resource(m.Resource).Namespace(o.GetNamespace())
	}
	_, err = r.Apply(ctx, o.GetName(), o, opts)
	return m.Scope.Name(), err
}

// rule is one verb on one resource (or non-resource URL) of a role.
type rule struct{ group, resource, name, verb string }

func flatten(rules []rbacv1.PolicyRule) []rule {
	var out []rule
	for _, r := range rules {
		for _, v := range r.Verbs {
			for _, u := range r.NonResourceURLs {
				out = append(out, rule{resource: u, verb: v})
			}
			for _, g := range r.APIGroups {
				for _, res := range r.Resources {
					if len(r.ResourceNames) == 0 {
						out = append(out, rule{group: g, resource: res, verb: v})
					}
					for _, n := range r.ResourceNames {
						out = append(out, rule{group: g, resource: res, name: n, verb: v})
					}
				}
			}
		}
	}
	return out
}

func verbs(group, resource string, vs ...string) []rule {
	var out []rule
	for _, v := range vs {
		out = append(out, rule{group: group, resource: resource, verb: v})
	}
	return out
}

// allowed is the documented RBAC of credbroker, role by role (the names
// before an overlay's prefix or suffix). Every rule of every rendered Role
// and ClusterRole must be listed here.
var allowed = map[string][]rule{
	// The broker on the hub.
	"ClusterRole credbroker-broker": slices.Concat(
		verbs("authentication.k8s.io", "tokenreviews", "create"),
		verbs("authorization.k8s.io", "subjectaccessreviews", "create"),
		// An informer: list and watch, never get (test/binaries checks
		// what the broker uses).
		verbs("multicluster.x-k8s.io", "clusterprofiles", "list", "watch"),
		// Revocation triggers: hub RBAC changes and deleted consumer
		// ServiceAccounts (pkg/broker's trigger informers).
		verbs("rbac.authorization.k8s.io", "roles", "list", "watch"),
		verbs("rbac.authorization.k8s.io", "rolebindings", "list", "watch"),
		verbs("rbac.authorization.k8s.io", "clusterroles", "list", "watch"),
		verbs("rbac.authorization.k8s.io", "clusterrolebindings", "list", "watch"),
		verbs("", "serviceaccounts", "list", "watch"),
		// The hub issuer's keys (system:service-account-issuer-discovery
		// grants the same).
		[]rule{{resource: "/openid/v1/jwks", verb: "get"}},
	),
	// The ConfigMap of pending revokes in the broker's namespace
	// (pkg/grants PendingStore): created once, then read, watched alone
	// and updated by name.
	"Role credbroker-broker-pending-revokes": slices.Concat(
		verbs("", "configmaps", "create"),
		[]rule{
			{resource: "configmaps", name: "credbroker-pending-revokes", verb: "get"},
			{resource: "configmaps", name: "credbroker-pending-revokes", verb: "list"},
			{resource: "configmaps", name: "credbroker-pending-revokes", verb: "watch"},
			{resource: "configmaps", name: "credbroker-pending-revokes", verb: "update"},
		},
	),
	// The Lease of the revocation triggers in the broker's namespace
	// (pkg/broker runTriggers): created once, then read and renewed by
	// name.
	"Role credbroker-broker-triggers-lease": slices.Concat(
		verbs("coordination.k8s.io", "leases", "create"),
		[]rule{
			{group: "coordination.k8s.io", resource: "leases", name: "credbroker-triggers", verb: "get"},
			{group: "coordination.k8s.io", resource: "leases", name: "credbroker-triggers", verb: "update"},
		},
	),
	// Only with components/publish-access-provider.
	"ClusterRole credbroker-broker-publish": verbs("multicluster.x-k8s.io", "clusterprofiles/status", "patch"),
	"Role credbroker-broker-publish-lease": slices.Concat(
		verbs("coordination.k8s.io", "leases", "create"),
		[]rule{
			{group: "coordination.k8s.io", resource: "leases", name: "credbroker-publisher", verb: "get"},
			{group: "coordination.k8s.io", resource: "leases", name: "credbroker-publisher", verb: "update"},
			{group: "coordination.k8s.io", resource: "leases", name: "credbroker-publisher", verb: "patch"},
		},
	),
	// Not bound by deploy/: for the identities that may set
	// credbroker.io/agent-spiffe-id (hub admission policy).
	"ClusterRole credbroker-agent-spiffe-id-writer": verbs("multicluster.x-k8s.io", "clusterprofiles", "set-agent-spiffe-id"),
	// Not bound by deploy/: for the spoke admins who may write the opt-in
	// annotations of ServiceAccounts (spoke/optin-admission.yaml).
	"ClusterRole credbroker-opt-in-writer": verbs("credbroker.io", "serviceaccounts", "set-opt-in"),
	// The agent on a spoke: what pkg/spoke and pkg/agent call.
	"ClusterRole credbroker-agent": slices.Concat(
		// An informer: the agent reads ServiceAccounts from its cache,
		// never with a get (test/binaries checks what the agent uses).
		verbs("", "serviceaccounts", "list", "watch"),
		verbs("", "serviceaccounts/token", "create"),
		verbs("", "secrets", "create", "patch", "delete", "list", "watch"),
		// Whether a ServiceAccount may escalate, before minting for it.
		verbs("authorization.k8s.io", "subjectaccessreviews", "create"),
	),
	// Only with components/csi-driver-spiffe: the driver acts with the pod's
	// own token.
	"Role credbroker-csi-driver-spiffe": verbs("cert-manager.io", "certificaterequests", "create"),
}

// baseName strips the renamed overlay's suffix.
func baseName(name string) string { return strings.TrimSuffix(name, renamedSuffix) }

// No rendered Role or ClusterRole grants anything beyond the documented
// list, and the agent's is exactly test/framework's AgentRules, with which
// the e2e agents run.
func TestRBACAllowList(t *testing.T) {
	seen := map[string]bool{}
	for _, tg := range targets(t) {
		t.Run(tg.name, func(t *testing.T) {
			for _, o := range kustomize(t, tg.dir) {
				if o.GetKind() != "Role" && o.GetKind() != "ClusterRole" {
					continue
				}
				var role rbacv1.ClusterRole // Role has the same rules
				require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &role))
				key := o.GetKind() + " " + baseName(o.GetName())
				list, ok := allowed[key]
				if !assert.True(t, ok, "%s is not in the documented allow-list", describe(o)) {
					continue
				}
				seen[key] = true
				assert.Empty(t, role.AggregationRule, "%s aggregates other roles", describe(o))
				for _, r := range flatten(role.Rules) {
					assert.Contains(t, list, r, "%s grants %+v beyond the documented list", describe(o), r)
				}
				if key == "ClusterRole credbroker-agent" {
					assert.ElementsMatch(t, flatten(framework.AgentRules()), flatten(role.Rules),
						"deploy/spoke/rbac.yaml and test/framework.AgentRules differ")
				}
			}
		})
	}
	for key := range allowed {
		assert.True(t, seen[key], "%s is documented but no render has it", key)
	}
}

// Every container image is ghcr.io/credbroker/<binary>:<VERSION>, or a
// pinned third-party image.
func TestImagesMatchVersion(t *testing.T) {
	raw, err := os.ReadFile("../VERSION")
	require.NoError(t, err)
	version := strings.TrimSpace(string(raw))
	require.Regexp(t, `^v\d+\.\d+\.\d+`, version)
	ours := regexp.MustCompile(`^ghcr\.io/credbroker/(broker|spoke-agent|credbroker-plugin):` + regexp.QuoteMeta(version) + `$`)
	for _, tg := range targets(t) {
		t.Run(tg.name, func(t *testing.T) {
			for _, o := range kustomize(t, tg.dir) {
				spec, ok, _ := unstructured.NestedMap(o.Object, "spec", "template", "spec")
				if !ok {
					continue
				}
				var pod corev1.PodSpec
				require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(spec, &pod))
				for _, c := range slices.Concat(pod.InitContainers, pod.Containers) {
					if !thirdPartyImages[c.Image] {
						assert.Regexp(t, ours, c.Image, "%s container %s", describe(o), c.Name)
					}
				}
			}
		})
	}
}

// In every spoke render, the agent's admission policies take the agent's
// own ServiceAccount as their parameter, and their bindings name them:
// otherwise an overlay that renames or moves the agent leaves it
// unconstrained.
func TestAdmissionNamesTheAgent(t *testing.T) {
	for _, tg := range targets(t) {
		if tg.cluster != spoke || strings.HasPrefix(tg.name, "monitoring") {
			continue // monitoring installs no agent
		}
		t.Run(tg.name, func(t *testing.T) {
			objs := kustomize(t, tg.dir)
			agentSA := agentServiceAccount(t, objs)
			policies := map[string]bool{}
			var optIn string // credbroker-opt-in guards everyone's opt-ins and takes no parameter
			for _, o := range objs {
				if o.GetKind() == "ValidatingAdmissionPolicy" && baseName(o.GetName()) == "credbroker-opt-in" {
					optIn = o.GetName()
					continue
				}
				if o.GetKind() == "ValidatingAdmissionPolicy" {
					policies[o.GetName()] = true
					kind, _, _ := unstructured.NestedString(o.Object, "spec", "paramKind", "kind")
					assert.Equal(t, "ServiceAccount", kind, "%s", describe(o))
				}
			}
			require.Len(t, policies, 3)
			bound := map[string]bool{}
			for _, o := range objs {
				if o.GetKind() != "ValidatingAdmissionPolicyBinding" {
					continue
				}
				policy, _, _ := unstructured.NestedString(o.Object, "spec", "policyName")
				if baseName(o.GetName()) == "credbroker-opt-in" {
					assert.Equal(t, optIn, policy, "%s binds another policy than the rendered credbroker-opt-in", describe(o))
					continue
				}
				ns, _, _ := unstructured.NestedString(o.Object, "spec", "paramRef", "namespace")
				name, _, _ := unstructured.NestedString(o.Object, "spec", "paramRef", "name")
				assert.True(t, policies[policy], "%s binds %q, which is not rendered", describe(o), policy)
				bound[policy] = true
				assert.Equal(t, agentSA, ns+"/"+name, "%s takes another ServiceAccount than the agent's", describe(o))
			}
			assert.Len(t, bound, len(policies), "every policy is bound")
		})
	}
}

// agentServiceAccount returns namespace/name of the DaemonSet's
// ServiceAccount, after checking that the agent's ClusterRole is bound to it.
func agentServiceAccount(t *testing.T, objs []*unstructured.Unstructured) string {
	t.Helper()
	var sa string
	for _, o := range objs {
		if o.GetKind() == "DaemonSet" {
			name, _, _ := unstructured.NestedString(o.Object, "spec", "template", "spec", "serviceAccountName")
			sa = o.GetNamespace() + "/" + name
		}
	}
	require.NotEmpty(t, sa, "no agent DaemonSet")
	var subjects []string
	for _, o := range objs {
		if o.GetKind() == "ClusterRoleBinding" && baseName(o.GetName()) == "credbroker-agent" {
			var b rbacv1.ClusterRoleBinding
			require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &b))
			for _, s := range b.Subjects {
				subjects = append(subjects, s.Namespace+"/"+s.Name)
			}
		}
	}
	require.Equal(t, []string{sa}, subjects, "the agent's ClusterRole is bound to the DaemonSet's ServiceAccount")
	return sa
}

// Attack: an operator follows the docs and renames the agent per spoke (a
// nameSuffix for csi-driver-spiffe) or moves it to another namespace. The
// renamed agent's identity must still be held to its grants by the
// admission policies, installed for real from the render: it may not write
// a Secret that is not a grant, nor mint an unbound token.
func TestAdmissionHoldsARenamedAgent(t *testing.T) {
	e := clusters(t)
	c := e.Spokes[0]
	ctx := context.Background()
	a := newApplier(t, c)
	objs := kustomize(t, overlay(t, "spoke", nil, "namespace: "+renamedNamespace+"-real\nnameSuffix: "+renamedSuffix+"\n"))
	var saName string
	for _, kind := range []string{"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} {
		for _, o := range objs {
			if o.GetKind() != kind {
				continue
			}
			if kind == "ServiceAccount" {
				saName = o.GetName()
			}
			_, err := a.apply(ctx, o, false)
			require.NoError(t, err, "create %s", describe(o))
		}
	}
	require.Equal(t, "credbroker-agent"+renamedSuffix, saName)
	user, groups := framework.ServiceAccountUser(renamedNamespace+"-real", saName)
	cfg := rest.CopyConfig(c.Config)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: user, Groups: append(groups, "system:authenticated")}
	agent := kubernetes.NewForConfigOrDie(cfg)
	// A namespace of this run's own, so that the test may run twice.
	victim := fmt.Sprintf("victim-%d", time.Now().UnixNano())
	require.NoError(t, c.EnsureNamespace(ctx, victim))

	// The policies take effect once the API server has loaded them and
	// their parameter.
	var lastErr error
	require.Eventually(t, func() bool {
		s, err := agent.CoreV1().Secrets(victim).Create(ctx, &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{GenerateName: "stolen-"},
			StringData: map[string]string{"k": "v"},
		}, metav1.CreateOptions{})
		if err == nil {
			_ = c.Client.CoreV1().Secrets(victim).Delete(ctx, s.Name, metav1.DeleteOptions{})
		}
		lastErr = err
		return apierrors.IsForbidden(err) && strings.Contains(err.Error(), "only Secrets of type credbroker.io/grant")
	}, 20*time.Second, 100*time.Millisecond, "the renamed agent still writes any Secret: %v", lastErr)

	_, err := c.CreateServiceAccount(ctx, victim, "admin-sa", nil)
	require.NoError(t, err)
	_, err = agent.CoreV1().ServiceAccounts(victim).CreateToken(ctx, "admin-sa", &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
	require.Error(t, err)
	assert.True(t, apierrors.IsForbidden(err), "%v", err)
	assert.Contains(t, err.Error(), "only tokens bound to a credbroker grant Secret")

	// Only the renamed agent writes a grant; anyone else, even an admin,
	// may only delete one.
	grant := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{GenerateName: "credbroker-grant-", Labels: map[string]string{"credbroker.io/grant": "true"}},
		Type:       "credbroker.io/grant",
	}
	require.Eventually(t, func() bool {
		_, lastErr = c.Client.CoreV1().Secrets(victim).Create(ctx, grant, metav1.CreateOptions{})
		return apierrors.IsForbidden(lastErr)
	}, 20*time.Second, 100*time.Millisecond, "someone other than the renamed agent still writes grants: %v", lastErr)
	assert.Contains(t, lastErr.Error(), "only the credbroker agent (system:serviceaccount:"+renamedNamespace+"-real:"+saName+")")
	written, err := agent.CoreV1().Secrets(victim).Create(ctx, grant, metav1.CreateOptions{})
	require.NoError(t, err, "the renamed agent may not write a grant")
	require.NoError(t, c.Client.CoreV1().Secrets(victim).Delete(ctx, written.Name, metav1.DeleteOptions{}))
}

// The Argo CD patch merges into Argo CD's application controller, and the
// hub API server (1.35, where image volumes are on by default) accepts the
// result: the plugin's own image mounted where the cluster Secret's command
// names it, and the credbroker projected volume.
func TestArgoCDControllerPatch(t *testing.T) {
	dir := t.TempDir()
	for _, f := range []string{"testdata/argocd-application-controller.yaml", "examples/argocd-application-controller-patch.yaml"} {
		raw, err := os.ReadFile(f)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(dir, filepath.Base(f)), raw, 0o600))
	}
	require.NoError(t, os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(
		"apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - argocd-application-controller.yaml\n"+
			"patches:\n  - path: argocd-application-controller-patch.yaml\n"), 0o600))
	objs := kustomize(t, dir)
	var pod corev1.PodSpec
	for _, o := range objs {
		if o.GetKind() == "StatefulSet" {
			spec, _, err := unstructured.NestedMap(o.Object, "spec", "template", "spec")
			require.NoError(t, err)
			require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(spec, &pod))
		}
	}
	require.Len(t, pod.Containers, 1)
	mounts := map[string]string{}
	for _, m := range pod.Containers[0].VolumeMounts {
		mounts[m.Name] = m.MountPath
	}
	assert.Equal(t, map[string]string{"argocd-home": "/home/argocd", "credbroker-plugin": "/opt/credbroker", "credbroker": "/var/run/secrets/credbroker"}, mounts)
	for _, v := range pod.Volumes {
		if v.Name == "credbroker-plugin" {
			version, err := os.ReadFile("../VERSION")
			require.NoError(t, err)
			require.NotNil(t, v.Image)
			assert.Equal(t, "ghcr.io/credbroker/credbroker-plugin:"+strings.TrimSpace(string(version)), v.Image.Reference)
		}
	}
	accepted := newApplier(t, clusters(t).Hub).applyAll(t, objs)
	t.Logf("server-side dry-run accepted: %s", strings.Join(accepted, ", "))
}
