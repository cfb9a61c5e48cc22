package framework_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/credbroker/credbroker/pkg/token"
	"github.com/credbroker/credbroker/test/framework"
)

// One hub and one spoke for the whole package; tests isolate by namespace.
var (
	testEnv   *framework.Env
	startErr  error
	startTook time.Duration
)

func TestMain(m *testing.M) {
	flag.Parse()
	opts := framework.Options{Spokes: 1}
	if testing.Verbose() {
		opts.Log = funcr.New(func(prefix, args string) { fmt.Fprintln(os.Stderr, "framework:", args) }, funcr.Options{})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	began := time.Now()
	testEnv, startErr = framework.Start(ctx, opts)
	startTook = time.Since(began)
	cancel()

	code := m.Run()

	began = time.Now()
	if err := testEnv.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, "framework_test: stop:", err)
		code = max(code, 1)
	}
	if testing.Verbose() && startErr == nil {
		fmt.Fprintf(os.Stderr, "framework_test: hub+1 spoke started in %s, stopped in %s\n",
			startTook.Round(time.Millisecond), time.Since(began).Round(time.Millisecond))
	}
	os.Exit(code)
}

// env returns the shared environment, failing the test (never skipping) when
// it did not start, for example because the binaries are missing.
func env(t *testing.T) *framework.Env {
	t.Helper()
	if startErr != nil {
		t.Fatalf("start hub and spoke: %v", startErr)
	}
	return testEnv
}

// Start returns once the hub and each spoke it was asked for serve: every
// API server is ready when Start returns, not some time after. (How long
// start-up took is logged, not asserted: that would be a timing assertion.)
func TestStartedClustersAreReady(t *testing.T) {
	e := env(t)
	t.Logf("hub and %d spoke started in %s", len(e.Spokes), startTook.Round(time.Millisecond))
	require.Len(t, e.Spokes, 1, "the spokes asked for")
	for _, c := range append([]*framework.Cluster{e.Hub}, e.Spokes...) {
		body, err := c.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(t.Context())
		require.NoError(t, err, "%s is not ready", c.Name)
		assert.Equal(t, "ok", string(body), c.Name)
	}
}

func TestStartRequiresAssets(t *testing.T) {
	executable := func(dir string, names ...string) string {
		for _, n := range names {
			require.NoError(t, os.WriteFile(filepath.Join(dir, n), []byte("#!/bin/sh\n"), 0o755))
		}
		return dir
	}
	tests := []struct {
		name   string
		envVar string
		opts   framework.Options
	}{
		{name: "no assets dir and empty KUBEBUILDER_ASSETS", envVar: ""},
		{name: "KUBEBUILDER_ASSETS names an empty folder", envVar: t.TempDir()},
		{name: "assets dir without binaries", opts: framework.Options{AssetsDir: t.TempDir()}},
		{name: "assets dir with etcd only", opts: framework.Options{AssetsDir: executable(t.TempDir(), "etcd")}},
		{name: "assets dir with kube-apiserver only", opts: framework.Options{AssetsDir: executable(t.TempDir(), "kube-apiserver")}},
		{name: "assets dir with non-executable binaries", opts: framework.Options{AssetsDir: func() string {
			dir := t.TempDir()
			for _, n := range []string{"etcd", "kube-apiserver"} {
				require.NoError(t, os.WriteFile(filepath.Join(dir, n), nil, 0o644))
			}
			return dir
		}()}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv(framework.AssetsEnv, tt.envVar)
			e, err := framework.Start(t.Context(), tt.opts)
			require.Error(t, err)
			assert.Nil(t, e)
			assert.ErrorIs(t, err, framework.ErrMissingAssets)
			assert.Contains(t, err.Error(), "make testbin")
			assert.Contains(t, err.Error(), "KUBEBUILDER_ASSETS")
		})
	}

	t.Run("negative spoke count", func(t *testing.T) {
		_, err := framework.Start(t.Context(), framework.Options{Spokes: -1})
		require.Error(t, err)
		assert.NotErrorIs(t, err, framework.ErrMissingAssets)
	})
}

func TestStartFailureCleansUp(t *testing.T) {
	assets := t.TempDir()
	for _, bin := range []string{"etcd", "kube-apiserver"} {
		script := "#!/bin/sh\necho " + bin + " refuses to start >&2\nexit 1\n"
		require.NoError(t, os.WriteFile(filepath.Join(assets, bin), []byte(script), 0o755))
	}
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp) // where envtest puts the data and cert dirs

	e, err := framework.Start(t.Context(), framework.Options{AssetsDir: assets, StartTimeout: 5 * time.Second})
	require.Error(t, err)
	assert.Nil(t, e)
	assert.NotErrorIs(t, err, framework.ErrMissingAssets)
	assert.Contains(t, err.Error(), "etcd refuses to start", "the error carries the process output")
	t.Log(err)
	left, err := os.ReadDir(tmp)
	require.NoError(t, err)
	assert.Empty(t, left, "temporary dirs left behind")
}

func TestStopIsSafe(t *testing.T) {
	tests := []struct {
		name string
		env  *framework.Env
	}{
		{name: "nil env"},
		{name: "zero env", env: &framework.Env{}},
		{name: "partial env", env: &framework.Env{Spokes: []*framework.Cluster{nil, {Name: "spoke-2"}}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.NoError(t, tt.env.Stop())
			assert.NoError(t, tt.env.Stop())
		})
	}
}

func TestClusters(t *testing.T) {
	t.Parallel()
	e := env(t)
	require.Len(t, e.Spokes, 1)

	tests := []struct {
		cluster *framework.Cluster
		name    string
		hub     bool
	}{
		{cluster: e.Hub, name: "hub", hub: true},
		{cluster: e.Spokes[0], name: "spoke-1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := tt.cluster
			assert.Equal(t, tt.name, c.Name)
			assert.Equal(t, "https://"+tt.name+".credbroker.test", c.Issuer)
			assert.True(t, strings.HasPrefix(c.Server, "https://127.0.0.1:"), c.Server)
			assert.Equal(t, c.Server, c.Config.Host)
			assert.NotEmpty(t, c.CAData)
			assert.Equal(t, tt.hub, c.Inventory != nil)

			v, err := c.Client.Discovery().ServerVersion()
			require.NoError(t, err)
			// testbin builds without version ldflags, so GitVersion is a placeholder.
			assert.NotEmpty(t, v.GitVersion)

			kubeconfig, err := c.Kubeconfig()
			require.NoError(t, err)
			assert.Contains(t, string(kubeconfig), c.Server)
		})
	}
	assert.NotEqual(t, e.Hub.Server, e.Spokes[0].Server)
	assert.NotEqual(t, e.Hub.CAData, e.Spokes[0].CAData)
}

// jwtClaims decodes a JWT's claims without verifying it.
func jwtClaims(t *testing.T, token string) map[string]any {
	t.Helper()
	parts := strings.Split(token, ".")
	require.Len(t, parts, 3, "a JWT has three parts")
	payload, err := base64.RawURLEncoding.DecodeString(parts[1])
	require.NoError(t, err)
	var claims map[string]any
	require.NoError(t, json.Unmarshal(payload, &claims))
	return claims
}

// (1) and (2): a spoke mints a service account token with TokenRequest and
// authenticates it with TokenReview.
func TestSpokeTokenRequestAndReview(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	ns := unique("t-spoke-token")
	spoke := env(t).Spokes[0]

	sa, err := spoke.CreateServiceAccount(ctx, ns, "agent-target", map[string]string{"example.com/note": "x"})
	require.NoError(t, err)
	assert.Equal(t, "x", sa.Annotations["example.com/note"])

	token, err := spoke.Token(ctx, ns, "agent-target", nil, 10*time.Minute)
	require.NoError(t, err)
	require.NotEmpty(t, token)
	claims := jwtClaims(t, token)
	assert.Equal(t, spoke.Issuer, claims["iss"])
	assert.Equal(t, []any{spoke.Issuer}, claims["aud"])
	assert.InDelta(t, (10 * time.Minute).Seconds(), claims["exp"].(float64)-claims["iat"].(float64), 1)

	status, err := spoke.ReviewToken(ctx, token, nil)
	require.NoError(t, err)
	require.True(t, status.Authenticated, "spoke TokenReview: %+v", status)
	assert.Empty(t, status.Error)
	user, groups := framework.ServiceAccountUser(ns, "agent-target")
	assert.Equal(t, user, status.User.Username)
	assert.Equal(t, string(sa.UID), status.User.UID)
	assert.Subset(t, status.User.Groups, groups)
	assert.Equal(t, []string{spoke.Issuer}, status.Audiences)

	// The token also works as a bearer token against the spoke.
	client, err := kubernetes.NewForConfig(spoke.TokenConfig(token))
	require.NoError(t, err)
	_, err = client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
	assert.True(t, apierrors.IsForbidden(err), "want 403 for an authenticated SA without RBAC, got %v", err)
}

func TestHubTokenAudience(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	ns := unique("t-hub-aud")
	hub := env(t).Hub

	_, err := hub.CreateServiceAccount(ctx, ns, "consumer", nil)
	require.NoError(t, err)
	token, err := hub.Token(ctx, ns, "consumer", []string{"credbroker"}, time.Hour)
	require.NoError(t, err)

	tests := []struct {
		name          string
		audiences     []string
		authenticated bool
	}{
		{name: "credbroker audience", audiences: []string{"credbroker"}, authenticated: true},
		{name: "credbroker among others", audiences: []string{"other", "credbroker"}, authenticated: true},
		{name: "default audience", audiences: nil, authenticated: false},
		{name: "hub issuer audience", audiences: []string{hub.Issuer}, authenticated: false},
		{name: "other audience", audiences: []string{"other"}, authenticated: false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			status, err := hub.ReviewToken(ctx, token, tt.audiences)
			require.NoError(t, err)
			assert.Equal(t, tt.authenticated, status.Authenticated, "%+v", status)
			if tt.authenticated {
				assert.Equal(t, "system:serviceaccount:"+ns+":consumer", status.User.Username)
				assert.Equal(t, []string{"credbroker"}, status.Audiences)
			} else {
				assert.Empty(t, status.User.Username)
				assert.NotEmpty(t, status.Error)
			}
		})
	}
}

func TestTokensDoNotCrossClusters(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	ns := unique("t-cross")
	e := env(t)
	hub, spoke := e.Hub, e.Spokes[0]

	// The same service account exists on both, so only the issuer and the
	// signing key can tell the tokens apart.
	for _, c := range []*framework.Cluster{hub, spoke} {
		_, err := c.CreateServiceAccount(ctx, ns, "twin", nil)
		require.NoError(t, err)
	}
	mint := func(c *framework.Cluster, audiences []string) string {
		token, err := c.Token(ctx, ns, "twin", audiences, 10*time.Minute)
		require.NoError(t, err)
		return token
	}

	tests := []struct {
		name      string
		token     string
		reviewer  *framework.Cluster
		audiences []string
	}{
		{name: "spoke token on hub, default audience", token: mint(spoke, nil), reviewer: hub},
		{name: "spoke token on hub, credbroker audience", token: mint(spoke, []string{"credbroker"}), reviewer: hub, audiences: []string{"credbroker"}},
		{name: "spoke token on hub, spoke issuer audience", token: mint(spoke, nil), reviewer: hub, audiences: []string{spoke.Issuer}},
		{name: "hub token on spoke, credbroker audience", token: mint(hub, []string{"credbroker"}), reviewer: spoke, audiences: []string{"credbroker"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			status, err := tt.reviewer.ReviewToken(ctx, tt.token, tt.audiences)
			require.NoError(t, err)
			assert.False(t, status.Authenticated, "%+v", status)
			assert.Empty(t, status.User.Username)

			client, err := kubernetes.NewForConfig(tt.reviewer.TokenConfig(tt.token))
			require.NoError(t, err)
			_, err = client.CoreV1().Namespaces().Get(ctx, "default", metav1.GetOptions{})
			assert.True(t, apierrors.IsUnauthorized(err), "want 401, got %v", err)
		})
	}
}

// (3): a SubjectAccessReview on the hub allows creating the token
// subresource of exactly the granted ClusterProfile, for exactly the granted
// service account.
func TestClusterProfileTokenAccess(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	e := env(t)
	hub, spoke := e.Hub, e.Spokes[0]
	fleet, consumers := unique("t-fleet"), unique("t-consumers")

	exec := []byte(`{"apiVersion":"client.authentication.k8s.io/v1","command":"credbroker-plugin","interactiveMode":"Never"}`)
	cp, err := hub.CreateClusterProfile(ctx, fleet, "spoke-1", spoke.Access("credbroker", exec))
	require.NoError(t, err)
	require.Len(t, cp.Status.AccessProviders, 1)
	got, err := hub.Inventory.ApisV1alpha1().ClusterProfiles(fleet).Get(ctx, "spoke-1", metav1.GetOptions{})
	require.NoError(t, err)
	require.Len(t, got.Status.AccessProviders, 1)
	provider := got.Status.AccessProviders[0]
	assert.Equal(t, "credbroker", provider.Name)
	assert.Equal(t, spoke.Server, provider.Cluster.Server)
	assert.Equal(t, spoke.CAData, provider.Cluster.CertificateAuthorityData)
	require.Len(t, provider.Cluster.Extensions, 1)
	assert.Equal(t, framework.ExecExtensionName, provider.Cluster.Extensions[0].Name)
	assert.JSONEq(t, string(exec), string(provider.Cluster.Extensions[0].Extension.Raw))
	assert.Equal(t, framework.ClusterManagerName, got.Spec.ClusterManager.Name)

	bare, err := hub.CreateClusterProfile(ctx, fleet, "spoke-2", nil)
	require.NoError(t, err)
	assert.Empty(t, bare.Status.AccessProviders)

	for _, name := range []string{"granted", "ungranted"} {
		_, err := hub.CreateServiceAccount(ctx, consumers, name, nil)
		require.NoError(t, err)
	}
	require.NoError(t, hub.GrantClusterProfileToken(ctx, fleet, "spoke-1", consumers, "granted"))
	require.NoError(t, hub.GrantClusterProfileToken(ctx, fleet, "spoke-1", consumers, "granted"), "granting twice is a no-op")

	tokenAttrs := func(namespace, name string) authorizationv1.ResourceAttributes {
		return authorizationv1.ResourceAttributes{
			Namespace: namespace, Verb: "create", Group: "multicluster.x-k8s.io",
			Resource: "clusterprofiles", Subresource: "token", Name: name,
		}
	}
	tests := []struct {
		name    string
		sa      string
		attrs   authorizationv1.ResourceAttributes
		allowed bool
	}{
		{name: "granted SA, granted profile", sa: "granted", attrs: tokenAttrs(fleet, "spoke-1"), allowed: true},
		{name: "granted SA, other profile", sa: "granted", attrs: tokenAttrs(fleet, "spoke-2")},
		{name: "granted SA, same name in other namespace", sa: "granted", attrs: tokenAttrs("default", "spoke-1")},
		{name: "granted SA, get instead of create", sa: "granted", attrs: func() authorizationv1.ResourceAttributes {
			a := tokenAttrs(fleet, "spoke-1")
			a.Verb = "get"
			return a
		}()},
		{name: "granted SA, the profile itself", sa: "granted", attrs: func() authorizationv1.ResourceAttributes {
			a := tokenAttrs(fleet, "spoke-1")
			a.Subresource = ""
			return a
		}()},
		{name: "SA without the grant", sa: "ungranted", attrs: tokenAttrs(fleet, "spoke-1")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			allowed, err := hub.Allowed(ctx, framework.ServiceAccountSubject(consumers, tt.sa), tt.attrs)
			require.NoError(t, err)
			assert.Equal(t, tt.allowed, allowed)

			// The same question asked by the SA itself, authenticated by a
			// hub token, as the broker's callers would be.
			token, err := hub.Token(ctx, consumers, tt.sa, nil, 10*time.Minute)
			require.NoError(t, err)
			client, err := kubernetes.NewForConfig(hub.TokenConfig(token))
			require.NoError(t, err)
			attrs := tt.attrs
			self, err := client.AuthorizationV1().SelfSubjectAccessReviews().Create(ctx,
				&authorizationv1.SelfSubjectAccessReview{Spec: authorizationv1.SelfSubjectAccessReviewSpec{ResourceAttributes: &attrs}},
				metav1.CreateOptions{})
			require.NoError(t, err)
			assert.Equal(t, tt.allowed, self.Status.Allowed, "%+v", self.Status)
		})
	}
}

func TestGrantClusterWide(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	spoke := env(t).Spokes[0]
	ns := unique("t-grant")

	require.NoError(t, spoke.EnsureNamespace(ctx, ns))
	require.NoError(t, spoke.EnsureNamespace(ctx, ns), "EnsureNamespace is idempotent")
	for _, name := range []string{"lister", "bystander"} {
		_, err := spoke.CreateServiceAccount(ctx, ns, name, nil)
		require.NoError(t, err)
	}
	listNamespaces := []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"namespaces"}, Verbs: []string{"list"}}}
	require.NoError(t, spoke.Grant(ctx, "", framework.ServiceAccountSubject(ns, "lister"), listNamespaces))
	require.NoError(t, spoke.Grant(ctx, "", framework.ServiceAccountSubject(ns, "lister"), listNamespaces), "granting twice is a no-op")

	tests := []struct {
		sa      string
		allowed bool
	}{
		{sa: "lister", allowed: true},
		{sa: "bystander", allowed: false},
	}
	for _, tt := range tests {
		t.Run(tt.sa, func(t *testing.T) {
			token, err := spoke.Token(ctx, ns, tt.sa, nil, 0)
			require.NoError(t, err)
			client, err := kubernetes.NewForConfig(spoke.TokenConfig(token))
			require.NoError(t, err)
			list, err := client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
			if tt.allowed {
				require.NoError(t, err)
				assert.NotEmpty(t, list.Items)
			} else {
				assert.True(t, apierrors.IsForbidden(err), "want 403, got %v", err)
			}
		})
	}

	t.Run("user and group subjects", func(t *testing.T) {
		getPods := []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get"}}}
		require.NoError(t, spoke.Grant(ctx, ns, rbacv1.Subject{Kind: rbacv1.UserKind, Name: "alice"}, getPods))
		require.NoError(t, spoke.Grant(ctx, ns, rbacv1.Subject{Kind: rbacv1.GroupKind, Name: "readers"}, getPods))
		attrs := authorizationv1.ResourceAttributes{Namespace: ns, Verb: "get", Resource: "pods"}
		for _, s := range []rbacv1.Subject{{Kind: rbacv1.UserKind, Name: "alice"}, {Kind: rbacv1.GroupKind, Name: "readers"}} {
			allowed, err := spoke.Allowed(ctx, s, attrs)
			require.NoError(t, err)
			assert.True(t, allowed, "%s %s", s.Kind, s.Name)
		}
		allowed, err := spoke.Allowed(ctx, rbacv1.Subject{Kind: rbacv1.UserKind, Name: "bob"}, attrs)
		require.NoError(t, err)
		assert.False(t, allowed)
	})
}

// The audit log of every cluster records the credential id of a request's
// token in the form token.ID gives it, so a brokered token's audit line can
// be matched with the spoke's own record of what the token did.
func TestAuditLogNamesTheCredential(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	ns := unique("t-audit")
	spoke := env(t).Spokes[0]
	_, err := spoke.CreateServiceAccount(ctx, ns, "user", nil)
	require.NoError(t, err)
	tok, err := spoke.Token(ctx, ns, "user", nil, 10*time.Minute)
	require.NoError(t, err)
	client, err := kubernetes.NewForConfig(spoke.TokenConfig(tok))
	require.NoError(t, err)
	_, err = client.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	require.NoError(t, err)

	id := token.ID(tok)
	require.True(t, strings.HasPrefix(id, "JTI="), id)
	var events []framework.AuditEvent
	framework.Eventually(t, 10*time.Second, 50*time.Millisecond, "an audit event that carries "+id, func(c assert.TestingT) {
		events, err = spoke.AuditEvents(func(ev framework.AuditEvent) bool {
			return slices.Contains(ev.User.Extra[framework.CredentialIDExtra], id)
		})
		require.NoError(t, err)
		assert.NotEmpty(c, events, "events in %s with credential id %s", spoke.AuditLog, id)
	})
	assert.Equal(t, "system:serviceaccount:"+ns+":user", events[0].User.Username)
	assert.Equal(t, "create", events[0].Verb)
	assert.Contains(t, events[0].RequestURI, "selfsubjectreviews")
}

var names atomic.Int64

// unique returns prefix with a number no other call returned, so that a
// test run twice against the same API servers (-count=2) makes new objects.
func unique(prefix string) string { return fmt.Sprintf("%s-%d", prefix, names.Add(1)) }
