package spoke

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// mintHook runs inside a mint, on the grant the token is bound to.
type mintHook func(grant string)

// hookedTokens runs its hook, when one is set, before it passes a
// TokenRequest on.
type hookedTokens struct {
	TokenCreator
	hook atomic.Pointer[mintHook]
}

func (h *hookedTokens) CreateToken(ctx context.Context, namespace, name string, req *authenticationv1.TokenRequest) (*authenticationv1.TokenRequest, error) {
	if f := h.hook.Swap(nil); f != nil {
		(*f)(req.Spec.BoundObjectRef.Name)
	}
	return h.TokenCreator.CreateToken(ctx, namespace, name, req)
}

// hookedGrants runs its hook, when one is set, before it passes the patch
// that records a minted token's credential id on.
type hookedGrants struct {
	GrantStore
	hook atomic.Pointer[mintHook]
}

func (h *hookedGrants) Patch(ctx context.Context, namespace, name string, patch []byte) error {
	if f := h.hook.Swap(nil); f != nil {
		(*f)(name)
	}
	return h.GrantStore.Patch(ctx, namespace, name, patch)
}

// The race of a ServiceAccount whose opt-in is toggled: the policy worker
// revokes the grant of a mint between Mint's last check and its
// TokenRequest, or between the TokenRequest and the patch that records
// the credential id. The API server then answers that the grant Secret is
// not found, which is not the ServiceAccount being missing: the consumer
// is told PermissionDenied, never NotFound about a ServiceAccount that
// exists, nor Unavailable. Each interleaving is forced on a real API
// server, with the informers and the policy worker the agent runs.
func TestMintWhileItsGrantIsRevokedIntegration(t *testing.T) {
	_, cs := startAPIServer(t)
	ctx := t.Context()
	_, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: testNamespace}}, metav1.CreateOptions{})
	require.NoError(t, err)

	factory := informers.NewSharedInformerFactory(cs, 0)
	sas := factory.Core().V1().ServiceAccounts()
	grantInformer := startGrantInformer(t, cs)
	tokens := &hookedTokens{TokenCreator: NewTokenCreator(cs)}
	grants := &hookedGrants{GrantStore: NewGrantStore(cs, "")}
	m, err := New(Config{
		Tokens:          tokens,
		Grants:          grants,
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

	// withdraw removes the opt-in of sa and waits until the policy worker
	// has revoked grant: it is gone from the API server.
	withdraw := func(t *testing.T, sa string) mintHook {
		return func(grant string) {
			_, err := cs.CoreV1().ServiceAccounts(testNamespace).Patch(t.Context(), sa, types.MergePatchType,
				[]byte(`{"metadata":{"annotations":{"`+AllowedSubjectsAnnotation+`":null}}}`), metav1.PatchOptions{})
			require.NoError(t, err)
			waitGrantGone(t, cs, grant)
		}
	}
	// deleteGrant deletes grant, as anyone with RBAC on the Secrets of the
	// namespace may, which revokes it, while the policy still allows it.
	deleteGrant := func(t *testing.T, _ string) mintHook {
		return func(grant string) {
			require.NoError(t, cs.CoreV1().Secrets(testNamespace).Delete(t.Context(), grant, metav1.DeleteOptions{}))
		}
	}
	// deleteServiceAccount deletes sa itself.
	deleteServiceAccount := func(t *testing.T, sa string) mintHook {
		return func(string) {
			require.NoError(t, cs.CoreV1().ServiceAccounts(testNamespace).Delete(t.Context(), sa, metav1.DeleteOptions{}))
		}
	}

	tests := []struct {
		name string
		// during says what happens inside the mint; beforePatch runs it
		// after the TokenRequest rather than before.
		during      func(t *testing.T, sa string) mintHook
		beforePatch bool
		wantErr     string
		wantCode    codes.Code
	}{
		{
			name:     "the opt-in is withdrawn and its grant revoked before the TokenRequest",
			during:   withdraw,
			wantErr:  "spoke ServiceAccount spoke-apps/%[1]s changed its policy while the token was minted: the ServiceAccount no longer allows the hub user: permission denied",
			wantCode: codes.PermissionDenied,
		},
		{
			name:        "the opt-in is withdrawn and its grant revoked before the credential id is recorded",
			during:      withdraw,
			beforePatch: true,
			wantErr:     "spoke ServiceAccount spoke-apps/%[1]s changed its policy while the token was minted: the ServiceAccount no longer allows the hub user: permission denied",
			wantCode:    codes.PermissionDenied,
		},
		{
			name:     "the grant is deleted before the TokenRequest",
			during:   deleteGrant,
			wantErr:  "the grant spoke-apps/%[2]s of the token for spoke ServiceAccount spoke-apps/%[1]s was deleted while the token was minted, which revokes the token; ask again: permission denied",
			wantCode: codes.PermissionDenied,
		},
		{
			name:        "the grant is deleted before the credential id is recorded",
			during:      deleteGrant,
			beforePatch: true,
			wantErr:     "the grant spoke-apps/%[2]s of the token for spoke ServiceAccount spoke-apps/%[1]s was deleted while the token was minted, which revokes the token; ask again: permission denied",
			wantCode:    codes.PermissionDenied,
		},
		{
			name:     "the ServiceAccount is deleted before the TokenRequest",
			during:   deleteServiceAccount,
			wantErr:  "spoke ServiceAccount spoke-apps/%[1]s: not found",
			wantCode: codes.NotFound,
		},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sa := "toggled-" + string(rune('a'+i))
			createServiceAccount(t, cs, sa, argocd)
			require.Eventually(t, func() bool {
				got, err := sas.Lister().ServiceAccounts(testNamespace).Get(sa)
				return err == nil && allows(got, argocd, nil)
			}, 10*time.Second, 10*time.Millisecond, "the informer never saw the ServiceAccount")

			var grant string
			hook := mintHook(func(name string) {
				grant = name
				tt.during(t, sa)(name)
			})
			if tt.beforePatch {
				grants.hook.Store(&hook)
			} else {
				tokens.hook.Store(&hook)
			}
			resp, err := m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref(testNamespace, sa)})
			require.NotEmpty(t, grant, "the hook did not run")
			require.EqualError(t, err, fmt.Sprintf(tt.wantErr, sa, grant))
			assert.Equal(t, tt.wantCode, errdefs.Code(err))
			assert.Nil(t, resp)
			_, err = cs.CoreV1().Secrets(testNamespace).Get(t.Context(), grant, metav1.GetOptions{})
			assert.True(t, apierrors.IsNotFound(err), "the grant of a refused mint is still there: %v", err)
		})
	}
}

// waitGrantGone waits until the grant testNamespace/name is gone from the
// API server.
func waitGrantGone(t *testing.T, cs kubernetes.Interface, name string) {
	t.Helper()
	require.Eventually(t, func() bool {
		_, err := cs.CoreV1().Secrets(testNamespace).Get(t.Context(), name, metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	}, 10*time.Second, 10*time.Millisecond, "the policy worker never revoked grant %s", name)
}
