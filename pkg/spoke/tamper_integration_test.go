package spoke

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"

	"github.com/credbroker/credbroker/pkg/token"
	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// The attack, on a real API server and the agent's own informer: a spoke
// admin, or the opted-in ServiceAccount's own token where it may patch
// Secrets, removes the credbroker.io/grant label from a grant. An informer
// that selected grants by that label saw a delete: the agent told the
// brokers the grant was gone while it, and its token, lived. The agent
// must still see the grant, delete it, and report it gone only once it is.
func TestChangedGrantIsDeletedOnTheAPIServer(t *testing.T) {
	_, cs := startAPIServer(t)
	ctx := t.Context()
	_, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: testNamespace}}, metav1.CreateOptions{})
	require.NoError(t, err)
	createServiceAccount(t, cs, "deployer", argocd)

	factory := informers.NewSharedInformerFactory(cs, 0)
	saLister := factory.Core().V1().ServiceAccounts().Lister()
	informerCtx, stopInformers := context.WithCancel(ctx)
	factory.Start(informerCtx.Done())
	t.Cleanup(func() { stopInformers(); factory.Shutdown() })
	for typ, ok := range factory.WaitForCacheSync(ctx.Done()) {
		require.True(t, ok, "informer for %v did not sync", typ)
	}
	grantInformer := startGrantInformer(t, cs)
	var log syncLog
	m, err := New(Config{
		Tokens:          NewTokenCreator(cs),
		Grants:          NewGrantStore(cs, ""),
		GrantCache:      grantInformer.GetIndexer(),
		ServiceAccounts: saLister,
		Log:             testr.New(t),
	})
	require.NoError(t, err)
	m.log = log.logger()
	_, err = grantInformer.AddEventHandler(m.GrantEvents())
	require.NoError(t, err)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- m.Run(runCtx) }()
	t.Cleanup(func() { stop(); assert.NoError(t, <-done) })
	var r recorder
	defer m.Subscribe(r.fn)()

	resp, err := m.Mint(ctx, admitted("fleet/spoke-1"), &credbrokerv1alpha1.MintRequest{
		Subject: subject(argocd), ServiceAccount: ref(testNamespace, "deployer"),
	})
	require.NoError(t, err)
	id := token.ID(resp.GetToken())
	require.Eventually(t, func() bool { return slices.Contains(r.summary(), "+"+id) }, 10*time.Second, 20*time.Millisecond)
	require.True(t, tokenReview(t, cs, resp.GetToken()).Authenticated)
	names := grantNames(t, cs)
	require.Len(t, names, 1)
	name := names[0]

	_, err = cs.CoreV1().Secrets(testNamespace).Patch(ctx, name, types.MergePatchType,
		[]byte(`{"metadata":{"labels":{"`+GrantLabel+`":null}}}`), metav1.PatchOptions{})
	require.NoError(t, err)
	changed := time.Now()

	// The removal reaches the brokers only once the grant is gone.
	require.Eventually(t, func() bool { return slices.Contains(r.summary(), "-"+id) }, 10*time.Second, time.Millisecond,
		"the agent never reported the changed grant gone")
	_, err = cs.CoreV1().Secrets(testNamespace).Get(ctx, name, metav1.GetOptions{})
	require.True(t, apierrors.IsNotFound(err), "the agent reported a grant gone that still exists: %v", err)
	assert.Equal(t, []string{"+" + id, "-" + id}, r.summary())
	assert.Contains(t, log.String(), `"msg"="deleted a grant that someone other than the agent changed"`)
	assert.Contains(t, log.String(), `"change"="label credbroker.io/grant removed"`)
	assert.NotContains(t, log.String(), resp.GetToken())

	require.Eventually(t, func() bool { return !tokenReview(t, cs, resp.GetToken()).Authenticated }, 30*time.Second, 100*time.Millisecond,
		"the spoke still accepts the token of a changed grant")
	t.Logf("revocation lag: the spoke refused the token %s after its grant was changed", time.Since(changed).Round(100*time.Millisecond))
}
