package spoke

import (
	"context"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"

	"github.com/credbroker/credbroker/pkg/fleet"
	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// On a real API server and informer, wired as the agent wires them:
// withdrawing a subject or an audience deletes the grants it allowed, and
// only those, including for a ServiceAccount whose name is too long for a
// label.
func TestPolicyRevocationIntegration(t *testing.T) {
	_, cs := startAPIServer(t)
	ctx := t.Context()
	_, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: testNamespace}}, metav1.CreateOptions{})
	require.NoError(t, err)
	long := strings.Repeat("l", 70) // too long for a label value
	createServiceAccountWithAudiences(t, cs, "shared", argocd+","+flux, "vault")
	createServiceAccount(t, cs, "other", argocd)
	createServiceAccount(t, cs, long, argocd)

	factory := informers.NewSharedInformerFactory(cs, 0)
	sas := factory.Core().V1().ServiceAccounts()
	grantInformer := startGrantInformer(t, cs)
	m, err := New(Config{
		Tokens:          NewTokenCreator(cs),
		Grants:          NewGrantStore(cs, ""),
		GrantCache:      grantInformer.GetIndexer(),
		ServiceAccounts: sas.Lister(),
		Log:             testr.New(t),
	})
	require.NoError(t, err)
	_, err = grantInformer.AddEventHandler(m.GrantEvents())
	require.NoError(t, err)
	_, err = sas.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		UpdateFunc: func(old, now any) { m.PolicyChanged(old.(*corev1.ServiceAccount), now.(*corev1.ServiceAccount)) },
	})
	require.NoError(t, err)
	runCtx, stop := context.WithCancel(ctx)
	factory.Start(runCtx.Done())
	for typ, ok := range factory.WaitForCacheSync(ctx.Done()) {
		require.True(t, ok, "informer for %v did not sync", typ)
	}
	done := make(chan error, 1)
	go func() { done <- m.Run(runCtx) }()
	t.Cleanup(func() {
		stop()
		assert.NoError(t, <-done)
		factory.Shutdown()
	})

	// grantOfMint maps "<ServiceAccount> <hub user> <audiences>" to the
	// name of the grant of that mint.
	grantOfMint := map[string]string{}
	mint := func(user, sa string, audiences ...string) {
		t.Helper()
		resp, err := m.Mint(ctx, fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject(user), ServiceAccount: ref(testNamespace, sa), Audiences: audiences})
		require.NoError(t, err)
		st := tokenReview(t, cs, resp.GetToken(), audiences...)
		require.True(t, st.Authenticated, "TokenReview error: %s", st.Error)
		names := grantNames(t, cs)
		for _, n := range names {
			if !slices.Contains(slices.Collect(maps.Values(grantOfMint)), n) {
				grantOfMint[sa+" "+user+" "+strings.Join(audiences, ",")] = n
			}
		}
	}
	mint(argocd, "shared")
	mint(flux, "shared")
	mint(flux, "shared", "vault")
	mint(argocd, "other")
	mint(argocd, long)
	require.Len(t, grantNames(t, cs), 5)

	// patch sets annotation key of sa to value; "" removes it.
	patch := func(sa, key, value string) {
		t.Helper()
		raw := `null`
		if value != "" {
			raw = `"` + value + `"`
		}
		_, err := cs.CoreV1().ServiceAccounts(testNamespace).Patch(ctx, sa, types.MergePatchType,
			[]byte(`{"metadata":{"annotations":{"`+key+`":`+raw+`}}}`), metav1.PatchOptions{})
		require.NoError(t, err)
	}
	revoked := func(keys ...string) {
		t.Helper()
		for _, k := range keys {
			name := grantOfMint[k]
			require.NotEmpty(t, name, k)
			require.Eventually(t, func() bool { return !slices.Contains(grantNames(t, cs), name) }, 10*time.Second, 20*time.Millisecond,
				"grant of %s not revoked", k)
			delete(grantOfMint, k)
		}
		names := grantNames(t, cs)
		for k, name := range grantOfMint {
			assert.Contains(t, names, name, "grant of %s revoked", k)
		}
	}

	patch("shared", AllowedSubjectsAnnotation, flux)
	revoked("shared " + argocd + " ")
	patch("shared", AllowedAudiencesAnnotation, "")
	revoked("shared " + flux + " vault")
	patch(long, AllowedSubjectsAnnotation, flux)
	revoked(long + " " + argocd + " ")
	assert.Len(t, grantNames(t, cs), 2)
}
