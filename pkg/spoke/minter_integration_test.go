package spoke

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/testr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/token"
	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

const testNamespace = "spoke-apps"

// startAPIServer starts etcd and kube-apiserver from KUBEBUILDER_ASSETS and
// returns an admin clientset and the environment, stopped at cleanup.
func startAPIServer(t *testing.T) (*envtest.Environment, kubernetes.Interface) {
	t.Helper()
	assets := os.Getenv("KUBEBUILDER_ASSETS")
	if assets == "" {
		t.Fatal("KUBEBUILDER_ASSETS is not set: run make testbin, then export KUBEBUILDER_ASSETS=$(hack/testbin.sh), or run make test")
	}
	for _, bin := range []string{"kube-apiserver", "etcd"} {
		if _, err := os.Stat(filepath.Join(assets, bin)); err != nil {
			t.Fatalf("KUBEBUILDER_ASSETS=%s has no %s (%v): run make testbin", assets, bin, err)
		}
	}
	ctrllog.SetLogger(logr.Discard())
	// As test/framework does: a loaded 2-core machine starts an API server slowly.
	env := &envtest.Environment{BinaryAssetsDirectory: assets, ControlPlaneStartTimeout: time.Minute}
	cfg, err := env.Start()
	require.NoError(t, err, "start envtest")
	t.Cleanup(func() { assert.NoError(t, env.Stop()) })
	return env, kubernetes.NewForConfigOrDie(cfg)
}

// claims are the parts of a ServiceAccount JWT the test checks. They are
// read without verifying the signature; TokenReview does that.
type claims struct {
	Aud audience `json:"aud"`
	Iat int64    `json:"iat"`
	Exp int64    `json:"exp"`
	Sub string   `json:"sub"`
}

// audience is the JWT aud claim, which is a string when it has one element.
type audience []string

func (a *audience) UnmarshalJSON(b []byte) error {
	var one string
	if json.Unmarshal(b, &one) == nil {
		*a = audience{one}
		return nil
	}
	return json.Unmarshal(b, (*[]string)(a))
}

func decodeClaims(t *testing.T, tok string) claims {
	t.Helper()
	parts := strings.Split(tok, ".")
	require.Len(t, parts, 3)
	raw, err := base64.RawURLEncoding.DecodeString(parts[1])
	require.NoError(t, err)
	var c claims
	require.NoError(t, json.Unmarshal(raw, &c))
	return c
}

func tokenReview(t *testing.T, cs kubernetes.Interface, tok string, audiences ...string) authenticationv1.TokenReviewStatus {
	t.Helper()
	tr, err := cs.AuthenticationV1().TokenReviews().Create(t.Context(), &authenticationv1.TokenReview{
		Spec: authenticationv1.TokenReviewSpec{Token: tok, Audiences: audiences},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	return tr.Status
}

func createServiceAccount(t *testing.T, cs kubernetes.Interface, name, allowed string) *corev1.ServiceAccount {
	t.Helper()
	return createServiceAccountWithAudiences(t, cs, name, allowed, "")
}

// createServiceAccountWithAudiences is createServiceAccount that also sets
// AllowedAudiencesAnnotation, unless audiences is empty.
func createServiceAccountWithAudiences(t *testing.T, cs kubernetes.Interface, name, allowed, audiences string) *corev1.ServiceAccount {
	t.Helper()
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: name, Annotations: map[string]string{}}}
	if allowed != "" {
		sa.Annotations[AllowedSubjectsAnnotation] = allowed
	}
	if audiences != "" {
		sa.Annotations[AllowedAudiencesAnnotation] = audiences
	}
	sa, err := cs.CoreV1().ServiceAccounts(testNamespace).Create(t.Context(), sa, metav1.CreateOptions{})
	require.NoError(t, err)
	return sa
}

func TestMinterIntegration(t *testing.T) {
	env, cs := startAPIServer(t)
	ctx := t.Context()

	_, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: testNamespace}}, metav1.CreateOptions{})
	require.NoError(t, err)
	createServiceAccountWithAudiences(t, cs, "deployer", argocd, "credbroker-test, vault")
	createServiceAccount(t, cs, "closed", "")
	createServiceAccount(t, cs, "cloud-trusted", flux)
	createServiceAccountWithAudiences(t, cs, "irsa", flux, "sts.amazonaws.com")

	// The agent's view of the spoke: a real informer, as in the agent.
	factory := informers.NewSharedInformerFactory(cs, 0)
	saLister := factory.Core().V1().ServiceAccounts().Lister()
	informerCtx, stopInformers := context.WithCancel(ctx)
	factory.Start(informerCtx.Done())
	t.Cleanup(func() { stopInformers(); factory.Shutdown() })
	for typ, ok := range factory.WaitForCacheSync(ctx.Done()) {
		require.True(t, ok, "informer for %v did not sync", typ)
	}

	grantInformer := startGrantInformer(t, cs)
	m, err := New(Config{
		Tokens:          NewTokenCreator(cs),
		Grants:          NewGrantStore(cs, ""),
		GrantCache:      grantInformer.GetIndexer(),
		ServiceAccounts: saLister,
		MaxExpiration:   2 * time.Hour,
		Log:             testr.New(t),
	})
	require.NoError(t, err)
	_, err = grantInformer.AddEventHandler(m.GrantEvents())
	require.NoError(t, err)

	// The API server's default audiences are its issuer, which OIDC
	// discovery reports.
	raw, err := cs.CoreV1().RESTClient().Get().AbsPath("/.well-known/openid-configuration").DoRaw(ctx)
	require.NoError(t, err)
	var discovery struct {
		Issuer string `json:"issuer"`
	}
	require.NoError(t, json.Unmarshal(raw, &discovery))
	require.NotEmpty(t, discovery.Issuer)

	const deployerUser = "system:serviceaccount:" + testNamespace + ":deployer"

	t.Run("minted token passes TokenReview with the requested audiences and expiry", func(t *testing.T) {
		before := time.Now()
		resp, err := m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{
			Subject:           subject(argocd),
			ServiceAccount:    ref(testNamespace, "deployer"),
			Audiences:         []string{"credbroker-test", "vault"},
			ExpirationSeconds: 900,
		})
		require.NoError(t, err)
		assert.Equal(t, testNamespace, resp.GetServiceAccount().GetNamespace())
		assert.Equal(t, "deployer", resp.GetServiceAccount().GetName())

		st := tokenReview(t, cs, resp.GetToken(), "vault")
		require.True(t, st.Authenticated, "TokenReview error: %s", st.Error)
		assert.Equal(t, deployerUser, st.User.Username)
		assert.Equal(t, []string{"vault"}, st.Audiences)
		// The credential id the Minter logs is the one the spoke audits.
		assert.Equal(t, []string{token.ID(resp.GetToken())},
			[]string(st.User.Extra["authentication.kubernetes.io/credential-id"]))

		// A token for other audiences is not valid for the API server itself.
		st = tokenReview(t, cs, resp.GetToken())
		assert.False(t, st.Authenticated)

		c := decodeClaims(t, resp.GetToken())
		assert.Equal(t, audience{"credbroker-test", "vault"}, c.Aud)
		assert.Equal(t, deployerUser, c.Sub)
		assert.Equal(t, int64(900), c.Exp-c.Iat)
		exp := resp.GetExpirationTime().AsTime()
		assert.InDelta(t, c.Exp, exp.Unix(), 1, "expirationTime and the exp claim differ")
		assert.WithinRange(t, exp, before.Add(900*time.Second-time.Second), time.Now().Add(900*time.Second+time.Second))
	})

	t.Run("no audiences means the API server's default, and a short expiry is raised to the minimum", func(t *testing.T) {
		resp, err := m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{
			Subject:           subject(argocd),
			ServiceAccount:    ref(testNamespace, "deployer"),
			ExpirationSeconds: 60,
		})
		require.NoError(t, err)
		st := tokenReview(t, cs, resp.GetToken())
		require.True(t, st.Authenticated, "TokenReview error: %s", st.Error)
		assert.Equal(t, deployerUser, st.User.Username)

		c := decodeClaims(t, resp.GetToken())
		assert.Equal(t, audience{discovery.Issuer}, c.Aud)
		assert.Equal(t, []string(c.Aud), st.Audiences)
		assert.Equal(t, int64(600), c.Exp-c.Iat)
	})

	t.Run("unnamed request picks the single allowed ServiceAccount; zero expiry is the maximum", func(t *testing.T) {
		resp, err := m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject(argocd)})
		require.NoError(t, err)
		assert.Equal(t, "deployer", resp.GetServiceAccount().GetName())
		st := tokenReview(t, cs, resp.GetToken())
		require.True(t, st.Authenticated, "TokenReview error: %s", st.Error)
		assert.Equal(t, deployerUser, st.User.Username)
		c := decodeClaims(t, resp.GetToken())
		assert.Equal(t, int64(7200), c.Exp-c.Iat)
	})

	t.Run("ServiceAccount that has not opted in is refused", func(t *testing.T) {
		resp, err := m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref(testNamespace, "closed")})
		require.EqualError(t, err, "spoke ServiceAccount spoke-apps/closed does not allow hub user "+argocd+
			"; a spoke admin must add "+argocd+" to its credbroker.io/allowed-subjects annotation: permission denied")
		assert.ErrorIs(t, err, errdefs.ErrPermissionDenied)
		assert.Nil(t, resp)

		_, err = m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject("mallory")})
		require.EqualError(t, err, "no spoke ServiceAccount allows hub user mallory; a spoke admin must annotate one with credbroker.io/allowed-subjects: permission denied")
		assert.ErrorIs(t, err, errdefs.ErrPermissionDenied)
	})

	t.Run("an audience the ServiceAccount does not list is refused", func(t *testing.T) {
		for _, name := range []string{"cloud-trusted", "deployer"} {
			resp, err := m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{
				Subject:        subject(flux),
				ServiceAccount: ref(testNamespace, name),
				Audiences:      []string{"sts.amazonaws.com"},
			})
			if name == "deployer" {
				// Not allowed for flux at all: the subject check comes first.
				require.ErrorContains(t, err, AllowedSubjectsAnnotation)
			} else {
				require.EqualError(t, err, `spoke ServiceAccount spoke-apps/cloud-trusted does not allow audience "sts.amazonaws.com"; `+
					`a spoke admin must add it to its credbroker.io/allowed-audiences annotation: permission denied`)
			}
			assert.ErrorIs(t, err, errdefs.ErrPermissionDenied)
			assert.Nil(t, resp)
		}
	})

	t.Run("a listed audience is minted, and TokenReview accepts it for that audience only", func(t *testing.T) {
		resp, err := m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{
			Subject:        subject(flux),
			ServiceAccount: ref(testNamespace, "irsa"),
			Audiences:      []string{"sts.amazonaws.com"},
		})
		require.NoError(t, err)
		assert.Equal(t, audience{"sts.amazonaws.com"}, decodeClaims(t, resp.GetToken()).Aud)
		st := tokenReview(t, cs, resp.GetToken(), "sts.amazonaws.com")
		require.True(t, st.Authenticated, "TokenReview error: %s", st.Error)
		assert.Equal(t, "system:serviceaccount:"+testNamespace+":irsa", st.User.Username)
		assert.False(t, tokenReview(t, cs, resp.GetToken()).Authenticated, "the token must not pass for the API server's own audiences")
	})

	t.Run("informer sees an annotation being added and removed", func(t *testing.T) {
		createServiceAccount(t, cs, "late", "")
		req := &credbrokerv1alpha1.MintRequest{Subject: subject(flux), ServiceAccount: ref(testNamespace, "late")}
		require.Eventually(t, func() bool {
			_, err := m.Mint(t.Context(), fleet.ClusterRef{}, req)
			return errors.Is(err, errdefs.ErrPermissionDenied)
		}, 10*time.Second, 20*time.Millisecond, "informer never saw the new ServiceAccount")

		patch := []byte(`{"metadata":{"annotations":{"credbroker.io/allowed-subjects":"` + flux + `"}}}`)
		_, err := cs.CoreV1().ServiceAccounts(testNamespace).Patch(t.Context(), "late", types.MergePatchType, patch, metav1.PatchOptions{})
		require.NoError(t, err)
		var resp *credbrokerv1alpha1.MintResponse
		require.Eventually(t, func() bool {
			resp, err = m.Mint(t.Context(), fleet.ClusterRef{}, req)
			return err == nil
		}, 10*time.Second, 20*time.Millisecond, "informer never saw the annotation")
		st := tokenReview(t, cs, resp.GetToken())
		require.True(t, st.Authenticated, "TokenReview error: %s", st.Error)
		assert.Equal(t, "system:serviceaccount:"+testNamespace+":late", st.User.Username)

		patch = []byte(`{"metadata":{"annotations":{"credbroker.io/allowed-subjects":null}}}`)
		_, err = cs.CoreV1().ServiceAccounts(testNamespace).Patch(t.Context(), "late", types.MergePatchType, patch, metav1.PatchOptions{})
		require.NoError(t, err)
		require.Eventually(t, func() bool {
			_, err := m.Mint(t.Context(), fleet.ClusterRef{}, req)
			return errors.Is(err, errdefs.ErrPermissionDenied)
		}, 10*time.Second, 20*time.Millisecond, "informer never saw the annotation go")
	})

	t.Run("agent without RBAC on serviceaccounts/token gets Unavailable", func(t *testing.T) {
		agent, err := env.AddUser(envtest.User{Name: "credbroker-agent"}, nil)
		require.NoError(t, err)
		weak, err := New(Config{
			Tokens:          NewTokenCreator(kubernetes.NewForConfigOrDie(agent.Config())),
			Grants:          NewGrantStore(cs, ""),
			GrantCache:      emptyGrantCache(),
			ServiceAccounts: saLister,
		})
		require.NoError(t, err)
		before := grantNames(t, cs)
		_, err = weak.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject(argocd)})
		assert.Equal(t, before, grantNames(t, cs), "the grant of a failed mint must be deleted")
		require.EqualError(t, err, "spoke API server forbids the agent to mint tokens for ServiceAccount spoke-apps/deployer; "+
			"grant the agent's ServiceAccount create on serviceaccounts/token: "+
			`serviceaccounts "deployer" is forbidden: User "credbroker-agent" cannot create resource "serviceaccounts/token" in API group "" in the namespace "spoke-apps": unavailable`)
		assert.ErrorIs(t, err, errdefs.ErrUnavailable)
	})

	// The UID pin needs a 1.34 or later API server; the test binaries are
	// newer.
	t.Run("stale cache: the API server refuses a replaced or deleted ServiceAccount", func(t *testing.T) {
		old := createServiceAccount(t, cs, "replaced", argocd)
		require.NoError(t, cs.CoreV1().ServiceAccounts(testNamespace).Delete(t.Context(), "replaced", metav1.DeleteOptions{}))
		createServiceAccount(t, cs, "replaced", "")
		gone := serviceAccount(testNamespace, "gone", argocd)

		// A cache that still holds the old objects, as an informer that has
		// not caught up would.
		stale, err := New(Config{Tokens: NewTokenCreator(cs), Grants: NewGrantStore(cs, ""), GrantCache: emptyGrantCache(), ServiceAccounts: lister(t, old, gone)})
		require.NoError(t, err)

		_, err = stale.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref(testNamespace, "replaced")})
		require.EqualError(t, err, "spoke ServiceAccount spoke-apps/replaced was replaced since the agent's cache saw it; retry once the cache catches up: unavailable")
		assert.ErrorIs(t, err, errdefs.ErrUnavailable)

		_, err = stale.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref(testNamespace, "gone")})
		require.EqualError(t, err, "spoke ServiceAccount spoke-apps/gone: not found")
		assert.ErrorIs(t, err, errdefs.ErrNotFound)
	})

	t.Run("deleting the grant revokes the token", func(t *testing.T) {
		resp, err := m.Mint(t.Context(), admitted("fleet/spoke-1"), &credbrokerv1alpha1.MintRequest{
			Subject:        subject(argocd),
			ServiceAccount: ref(testNamespace, "deployer"),
			Audiences:      []string{"vault"},
		})
		require.NoError(t, err)
		id := token.ID(resp.GetToken())
		require.True(t, strings.HasPrefix(id, "JTI="), id)

		// The grant is found by the jti, as a spoke admin would from an
		// audit event.
		list, err := cs.CoreV1().Secrets("").List(t.Context(), metav1.ListOptions{
			LabelSelector: GrantJTILabel + "=" + strings.TrimPrefix(id, "JTI="),
		})
		require.NoError(t, err)
		require.Len(t, list.Items, 1)
		grant := list.Items[0]
		assert.Equal(t, testNamespace, grant.Namespace)
		assert.Equal(t, GrantType, grant.Type)
		assert.Empty(t, grant.Data)
		assert.Equal(t, id, grant.Annotations[GrantCredentialIDAnnotation])
		assert.Equal(t, argocd, grant.Annotations[GrantHubUserAnnotation])
		assert.Equal(t, "hub-uid", grant.Annotations[GrantHubUIDAnnotation])
		assert.Equal(t, "fleet/spoke-1", grant.Annotations[GrantClusterProfileAnnotation])
		assert.Equal(t, "vault", grant.Annotations[GrantAudiencesAnnotation])
		assert.Equal(t, resp.GetExpirationTime().AsTime().UTC().Format(time.RFC3339), grant.Annotations[GrantExpirationAnnotation])

		st := tokenReview(t, cs, resp.GetToken(), "vault")
		require.True(t, st.Authenticated, "TokenReview error: %s", st.Error)
		assert.Equal(t, []string{id}, []string(st.User.Extra["authentication.kubernetes.io/credential-id"]))

		require.NoError(t, cs.CoreV1().Secrets(testNamespace).Delete(t.Context(), grant.Name, metav1.DeleteOptions{}))
		deleted := time.Now()
		require.Eventually(t, func() bool {
			return !tokenReview(t, cs, resp.GetToken(), "vault").Authenticated
		}, 30*time.Second, 100*time.Millisecond, "the spoke still accepts the token of a deleted grant")
		t.Logf("revocation lag: the spoke refused the token %s after its grant was deleted", time.Since(deleted).Round(100*time.Millisecond))
	})

	t.Run("the grant informer reports grants, and revoke deletes them for the admitted ClusterProfile only", func(t *testing.T) {
		var r recorder
		defer m.Subscribe(r.fn)()
		cluster := admitted("fleet/spoke-1")
		cluster.UID = "uid-spoke-1"
		sub := subject(argocd)
		sub.Groups = []string{"system:serviceaccounts", "team,a"}
		resp, err := m.Mint(t.Context(), cluster, &credbrokerv1alpha1.MintRequest{Subject: sub, ServiceAccount: ref(testNamespace, "deployer")})
		require.NoError(t, err)
		id := token.ID(resp.GetToken())

		require.Eventually(t, func() bool { return slices.Contains(r.summary(), "+"+id) }, 10*time.Second, 20*time.Millisecond,
			"the informer never reported the grant's credential id")
		i := slices.IndexFunc(m.Snapshot(), func(g *credbrokerv1alpha1.Grant) bool { return g.GetCredentialId() == id })
		require.GreaterOrEqual(t, i, 0, "the snapshot misses %s", id)
		g := m.Snapshot()[i]
		assert.Equal(t, sub.Groups, g.GetSubject().GetGroups())
		assert.Equal(t, argocd, g.GetSubject().GetUsername())
		assert.Equal(t, "hub-uid", g.GetSubject().GetUid())
		assert.Equal(t, "fleet", g.GetCluster().GetNamespace())
		assert.Equal(t, "spoke-1", g.GetCluster().GetName())
		assert.Equal(t, "uid-spoke-1", g.GetClusterUid())
		assert.Equal(t, resp.GetExpirationTime().AsTime(), g.GetExpirationTime().AsTime())
		grantName := g.GetSecret().GetName()

		// Another ClusterProfile's broker revokes nothing.
		got, err := m.Revoke(t.Context(), admitted("fleet/spoke-2"), &credbrokerv1alpha1.RevokeRequest{CredentialIds: []string{id}, Reason: "test"})
		require.NoError(t, err)
		assert.Empty(t, got.GetCredentialIds())
		assert.Contains(t, grantNames(t, cs), grantName)
		require.True(t, tokenReview(t, cs, resp.GetToken()).Authenticated)

		got, err = m.Revoke(t.Context(), cluster, &credbrokerv1alpha1.RevokeRequest{CredentialIds: []string{id}, Reason: "test"})
		require.NoError(t, err)
		assert.Equal(t, []string{id}, got.GetCredentialIds())
		_, err = cs.CoreV1().Secrets(testNamespace).Get(t.Context(), grantName, metav1.GetOptions{})
		require.True(t, apierrors.IsNotFound(err), "the grant is still there: %v", err)
		require.Eventually(t, func() bool { return slices.Contains(r.summary(), "-"+id) }, 10*time.Second, 20*time.Millisecond,
			"the informer never reported the grant's deletion")
		require.Eventually(t, func() bool { return !tokenReview(t, cs, resp.GetToken()).Authenticated }, 30*time.Second, 100*time.Millisecond,
			"the spoke still accepts a revoked token")

		// Revoked again: already gone.
		got, err = m.Revoke(t.Context(), cluster, &credbrokerv1alpha1.RevokeRequest{CredentialIds: []string{id}})
		require.NoError(t, err)
		assert.Equal(t, []string{id}, got.GetCredentialIds())

		// Revoked the moment it is minted, before the cache may have it.
		resp, err = m.Mint(t.Context(), cluster, &credbrokerv1alpha1.MintRequest{Subject: sub, ServiceAccount: ref(testNamespace, "deployer")})
		require.NoError(t, err)
		before := len(grantNames(t, cs))
		got, err = m.Revoke(t.Context(), cluster, &credbrokerv1alpha1.RevokeRequest{CredentialIds: []string{token.ID(resp.GetToken())}})
		require.NoError(t, err)
		assert.Equal(t, []string{token.ID(resp.GetToken())}, got.GetCredentialIds())
		assert.Len(t, grantNames(t, cs), before-1)
	})

	t.Run("an agent that cannot create grants mints nothing", func(t *testing.T) {
		agent, err := env.AddUser(envtest.User{Name: "credbroker-agent-no-secrets"}, nil)
		require.NoError(t, err)
		tokens := &countingTokens{TokenCreator: NewTokenCreator(cs)}
		weak, err := New(Config{
			Tokens:          tokens,
			Grants:          NewGrantStore(kubernetes.NewForConfigOrDie(agent.Config()), ""),
			GrantCache:      emptyGrantCache(),
			ServiceAccounts: saLister,
		})
		require.NoError(t, err)
		resp, err := weak.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject(argocd)})
		require.EqualError(t, err, "spoke API server forbids the agent to create the grant Secret the token would be bound to in namespace spoke-apps, so no token is minted; "+
			"grant the agent's ServiceAccount create on secrets and check the credbroker-agent-grants admission policy: "+
			`secrets is forbidden: User "credbroker-agent-no-secrets" cannot create resource "secrets" in API group "" in the namespace "spoke-apps": unavailable`)
		assert.ErrorIs(t, err, errdefs.ErrUnavailable)
		assert.Nil(t, resp)
		assert.Zero(t, tokens.n.Load(), "no token may be minted without a grant")
	})

	t.Run("a starting agent collects grants left over with a past expiry", func(t *testing.T) {
		past := time.Now().Add(-time.Minute).UTC().Format(time.RFC3339)
		future := time.Now().Add(time.Hour).UTC().Format(time.RFC3339)
		leftover := createSecret(t, cs, "leftover-", GrantType, past)
		live := createSecret(t, cs, "live-", GrantType, future)
		// Carries the grant label and a past expiry, but is not a grant.
		opaque := createSecret(t, cs, "opaque-", corev1.SecretTypeOpaque, past)

		// A new agent: its grant informer lists what its predecessor left.
		restarted, err := New(Config{
			Tokens:          NewTokenCreator(cs),
			Grants:          NewGrantStore(cs, ""),
			GrantCache:      startGrantInformer(t, cs).GetIndexer(),
			ServiceAccounts: saLister,
			Log:             testr.New(t),
		})
		require.NoError(t, err)
		runCtx, stop := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- restarted.Run(runCtx) }()
		t.Cleanup(func() { stop(); assert.NoError(t, <-done) })

		require.Eventually(t, func() bool {
			return !slices.Contains(grantNames(t, cs), leftover)
		}, 10*time.Second, 50*time.Millisecond, "the leftover grant was not collected")
		assert.Contains(t, grantNames(t, cs), live)
		_, err = cs.CoreV1().Secrets(testNamespace).Get(t.Context(), opaque, metav1.GetOptions{})
		assert.NoError(t, err, "the collector deleted a Secret that is not a grant")
	})

	// Revoke looks up each credential id the cache does not know: one
	// grant by its jti label, not every grant of the spoke; a jti too long
	// for a label value falls back to every grant rather than fail.
	t.Run("ListCredential selects the grant by its jti label", func(t *testing.T) {
		future := time.Now().Add(time.Hour).UTC().Format(time.RFC3339)
		withJTI := func(prefix, jti string) string {
			name := createSecret(t, cs, prefix, GrantType, future)
			patch, err := mintedPatch("JTI="+jti, [32]byte{}, time.Now().Add(time.Hour))
			require.NoError(t, err)
			require.NoError(t, NewGrantStore(cs, "").Patch(t.Context(), testNamespace, name, patch))
			return name
		}
		a := withJTI("jti-a-", "list-a")
		b := withJTI("jti-b-", "list-b")
		names := func(list []corev1.Secret) []string {
			var out []string
			for _, s := range list {
				out = append(out, s.Name)
			}
			return out
		}
		store := NewGrantStore(cs, testNamespace)

		got, err := store.ListCredential(t.Context(), "JTI=list-a")
		require.NoError(t, err)
		assert.Equal(t, []string{a}, names(got))

		got, err = store.ListCredential(t.Context(), "JTI="+strings.Repeat("x", 64))
		require.NoError(t, err)
		assert.Subset(t, names(got), []string{a, b})
	})
}

// startGrantInformer runs on cs the grant informer the agent runs, until
// the test ends, and returns it once it has synced.
func startGrantInformer(t *testing.T, cs kubernetes.Interface) cache.SharedIndexInformer {
	t.Helper()
	inf := NewGrantInformer(cs, "")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		inf.RunWithContext(ctx)
	}()
	t.Cleanup(func() { cancel(); <-done })
	require.True(t, cache.WaitForCacheSync(t.Context().Done(), inf.HasSynced), "the grant informer did not sync")
	return inf
}

// emptyGrantCache is the grant cache of an agent that knows no grants.
func emptyGrantCache() cache.Indexer {
	return cache.NewIndexer(cache.MetaNamespaceKeyFunc, GrantIndexers())
}

// countingTokens counts the TokenRequests it passes on.
type countingTokens struct {
	TokenCreator
	n atomic.Int32
}

func (c *countingTokens) CreateToken(ctx context.Context, namespace, name string, req *authenticationv1.TokenRequest) (*authenticationv1.TokenRequest, error) {
	c.n.Add(1)
	return c.TokenCreator.CreateToken(ctx, namespace, name, req)
}

// grantNames returns the names of the grants in testNamespace, sorted.
func grantNames(t *testing.T, cs kubernetes.Interface) []string {
	t.Helper()
	list, err := cs.CoreV1().Secrets(testNamespace).List(t.Context(), metav1.ListOptions{
		LabelSelector: GrantLabelSelector, FieldSelector: GrantFieldSelector,
	})
	require.NoError(t, err)
	var names []string
	for _, s := range list.Items {
		names = append(names, s.Name)
	}
	slices.Sort(names)
	return names
}

// createSecret creates a Secret of typ in testNamespace with the labels
// and annotations of a grant, as the agent writes them, and expiration,
// and returns its name.
func createSecret(t *testing.T, cs kubernetes.Interface, prefix string, typ corev1.SecretType, expiration string) string {
	t.Helper()
	annotations := map[string]string{}
	for _, k := range grantAnnotations {
		annotations[k] = ""
	}
	annotations[GrantExpirationAnnotation] = expiration
	s, err := cs.CoreV1().Secrets(testNamespace).Create(t.Context(), &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			GenerateName: prefix,
			Labels:       map[string]string{GrantLabel: "true", GrantServiceAccountLabel: ""},
			Annotations:  annotations,
		},
		Type: typ,
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	return s.Name
}
