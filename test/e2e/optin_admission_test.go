package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// applyTo creates on cluster every object of a deploy/ manifest, as it is
// shipped, and deletes them when the test ends.
func applyTo(t *testing.T, cluster *framework.Cluster, path string) {
	t.Helper()
	ctx := context.Background()
	client := cluster.Client
	for _, obj := range readObjects(t, path) {
		var err error
		switch o := obj.(type) {
		case *admissionregistrationv1.ValidatingAdmissionPolicy:
			_, err = client.AdmissionregistrationV1().ValidatingAdmissionPolicies().Create(ctx, o, metav1.CreateOptions{})
			t.Cleanup(func() {
				_ = client.AdmissionregistrationV1().ValidatingAdmissionPolicies().Delete(context.Background(), o.Name, metav1.DeleteOptions{})
			})
		case *admissionregistrationv1.ValidatingAdmissionPolicyBinding:
			_, err = client.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Create(ctx, o, metav1.CreateOptions{})
			t.Cleanup(func() {
				_ = client.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Delete(context.Background(), o.Name, metav1.DeleteOptions{})
			})
		case *rbacv1.ClusterRole:
			_, err = client.RbacV1().ClusterRoles().Create(ctx, o, metav1.CreateOptions{})
			t.Cleanup(func() {
				_ = client.RbacV1().ClusterRoles().Delete(context.Background(), o.Name, metav1.DeleteOptions{})
			})
		default:
			t.Fatalf("%s: no case for %T", path, obj)
		}
		require.NoError(t, err)
	}
}

// kubeAs is a client of cluster that acts as user, an authenticated user
// in no other group.
func kubeAs(t *testing.T, cluster *framework.Cluster, user string) kubernetes.Interface {
	t.Helper()
	cfg := rest.CopyConfig(cluster.Config)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: user, Groups: []string{"system:authenticated"}}
	c, err := kubernetes.NewForConfig(cfg)
	require.NoError(t, err)
	return c
}

// The attack: the owner of one spoke namespace, bound to the built-in edit
// role there and nothing else, opts a ServiceAccount of its own in for a
// victim's hub username (or for group:system:authenticated, everyone). The
// agent then finds two ServiceAccounts that allow the victim, and every
// exchange of the victim that names no ServiceAccount fails with
// FailedPrecondition; with the victim's own SA gone, the victim's writes
// would land in the owner's namespace. deploy/spoke/optin-admission.yaml
// lets only identities granted set-opt-in (ClusterRole
// credbroker-opt-in-writer, cluster-wide) write the opt-in annotations.
func TestNamespaceOwnerCannotLockOutConsumers(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]

	// The victim: opted in by the spoke admin; each exchange asks for an
	// audience of its own, so each is a mint that asks the agent, never a
	// cached token.
	victim := newConsumer(t, "credbroker", spoke.Name)
	audiences := []string{"first", "during", "after"}
	victimNS := optInAudiences(t, spoke, "victim", audiences, victim.username())
	mint := func(audience string) (*pb.ExchangeResponse, error) {
		return exchange(t, victim, &pb.ExchangeRequest{Cluster: clusterRef(spoke), Audiences: []string{audience}})
	}
	resp, err := mint(audiences[0])
	require.NoError(t, err)
	assert.Equal(t, "system:serviceaccount:"+victimNS+":victim", claims(t, resp.GetToken()).Sub)

	// The namespace owner: edit in its own namespace, as namespace owners
	// usually are.
	owner := "e2e-namespace-owner"
	ownerNS := uniqueName(t, "owned")
	require.NoError(t, spoke.EnsureNamespace(ctx, ownerNS))
	bindUserEdit(t, spoke, ownerNS, owner)
	asOwner := kubeAs(t, spoke, owner).CoreV1().ServiceAccounts(ownerNS)

	applyTo(t, spoke, "../../deploy/spoke/optin-admission.yaml")

	optInAnnotation := func(subjects string) map[string]string {
		return map[string]string{"credbroker.io/allowed-subjects": subjects}
	}
	// The API server starts enforcing a new policy within a few seconds.
	var probeErr error
	enforced := assert.Eventually(t, func() bool {
		sa, err := asOwner.Create(ctx, &corev1.ServiceAccount{
			ObjectMeta: metav1.ObjectMeta{GenerateName: "probe-", Annotations: optInAnnotation("nobody")},
		}, metav1.CreateOptions{})
		if err == nil {
			_ = spoke.Client.CoreV1().ServiceAccounts(ownerNS).Delete(ctx, sa.Name, metav1.DeleteOptions{})
		}
		probeErr = err
		return apierrors.IsForbidden(err)
	}, 30*time.Second, 200*time.Millisecond, "the policy is never enforced")
	t.Logf("policy enforced: %v (last probe: %v)", enforced, probeErr)

	refused := func(t *testing.T, err error) {
		t.Helper()
		require.Error(t, err, "the namespace owner wrote an opt-in annotation")
		assert.True(t, apierrors.IsForbidden(err), "%v", err)
		assert.Contains(t, err.Error(), "ValidatingAdmissionPolicy 'credbroker-opt-in'")
		assert.Contains(t, err.Error(), "set-opt-in")
		assert.Contains(t, err.Error(), "credbroker-opt-in-writer")
	}

	t.Run("the owner cannot opt a ServiceAccount in for the victim", func(t *testing.T) {
		_, err := asOwner.Create(ctx, &corev1.ServiceAccount{
			ObjectMeta: metav1.ObjectMeta{Name: "decoy", Annotations: optInAnnotation(victim.username())},
		}, metav1.CreateOptions{})
		if err == nil {
			// The attack worked: show what it does to the victim.
			sa, getErr := spoke.Client.CoreV1().ServiceAccounts(ownerNS).Get(ctx, "decoy", metav1.GetOptions{})
			require.NoError(t, getErr)
			require.NoError(t, deployment.WaitForServiceAccount(ctx, spoke, sa))
			_, mintErr := mint(audiences[1])
			t.Errorf("the namespace owner opted %s/decoy in for the victim; the victim's next exchange: %v", ownerNS, mintErr)
			return
		}
		refused(t, err)
	})

	t.Run("the owner cannot add the annotation to a ServiceAccount later", func(t *testing.T) {
		sa, err := asOwner.Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "plain"}}, metav1.CreateOptions{})
		require.NoError(t, err, "the owner still creates ServiceAccounts without it")
		for _, patch := range []string{
			`{"metadata":{"annotations":{"credbroker.io/allowed-subjects":"group:system:authenticated"}}}`,
			`{"metadata":{"annotations":{"credbroker.io/allowed-subjects":"` + victim.username() + `"}}}`,
			`{"metadata":{"annotations":{"credbroker.io/allowed-audiences":"sts.amazonaws.com"}}}`,
		} {
			_, err = asOwner.Patch(ctx, sa.Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
			if err == nil {
				got, _ := spoke.Client.CoreV1().ServiceAccounts(ownerNS).Get(ctx, sa.Name, metav1.GetOptions{})
				if got != nil {
					require.NoError(t, deployment.WaitForServiceAccount(ctx, spoke, got))
				}
				_, mintErr := mint(audiences[1])
				t.Errorf("the namespace owner patched %s; the victim's next exchange: %v", patch, mintErr)
				continue
			}
			refused(t, err)
		}
		// Other edits are the owner's to make.
		_, err = asOwner.Patch(ctx, sa.Name, types.MergePatchType, []byte(`{"metadata":{"labels":{"team":"a"},"annotations":{"example.com/x":"y"}}}`), metav1.PatchOptions{})
		require.NoError(t, err)
	})

	t.Run("the owner can neither change nor remove an opt-in the spoke admin wrote", func(t *testing.T) {
		admin := spoke.Client.CoreV1().ServiceAccounts(ownerNS)
		sa, err := admin.Create(ctx, &corev1.ServiceAccount{
			ObjectMeta: metav1.ObjectMeta{Name: "admin-opted-in", Annotations: map[string]string{
				"credbroker.io/allowed-subjects":  "system:serviceaccount:nowhere:nobody",
				"credbroker.io/allowed-audiences": "x",
			}},
		}, metav1.CreateOptions{})
		require.NoError(t, err, "the spoke admin (cluster-admin) writes the annotations")
		for _, patch := range []string{
			`{"metadata":{"annotations":{"credbroker.io/allowed-subjects":"system:serviceaccount:nowhere:nobody,` + victim.username() + `"}}}`,
			`{"metadata":{"annotations":{"credbroker.io/allowed-subjects":null}}}`,
			`{"metadata":{"annotations":{"credbroker.io/allowed-audiences":"x,sts.amazonaws.com"}}}`,
			`{"metadata":{"annotations":{"credbroker.io/allowed-audiences":null}}}`,
		} {
			_, err = asOwner.Patch(ctx, sa.Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
			if err == nil {
				t.Errorf("the namespace owner patched %s", patch)
				continue
			}
			refused(t, err)
		}
		got, err := asOwner.Update(ctx, func() *corev1.ServiceAccount {
			s, err := admin.Get(ctx, sa.Name, metav1.GetOptions{})
			require.NoError(t, err)
			s.Labels = map[string]string{"team": "b"}
			return s
		}(), metav1.UpdateOptions{})
		require.NoError(t, err, "an update that keeps the annotations is the owner's to make")
		assert.Equal(t, "system:serviceaccount:nowhere:nobody", got.Annotations["credbroker.io/allowed-subjects"])
		require.NoError(t, asOwner.Delete(ctx, sa.Name, metav1.DeleteOptions{}), "deleting its own ServiceAccount is the owner's right")
	})

	t.Run("a holder of credbroker-opt-in-writer opts in", func(t *testing.T) {
		writer := "e2e-opt-in-writer"
		bindUserEdit(t, spoke, ownerNS, writer)
		crb := &rbacv1.ClusterRoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: uniqueName(t, "e2e-opt-in-writer")},
			RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "credbroker-opt-in-writer"},
			Subjects:   []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: writer}},
		}
		_, err := spoke.Client.RbacV1().ClusterRoleBindings().Create(ctx, crb, metav1.CreateOptions{})
		require.NoError(t, err)
		t.Cleanup(func() {
			_ = spoke.Client.RbacV1().ClusterRoleBindings().Delete(context.Background(), crb.Name, metav1.DeleteOptions{})
		})
		asWriter := kubeAs(t, spoke, writer).CoreV1().ServiceAccounts(ownerNS)
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			sa, err := asWriter.Create(ctx, &corev1.ServiceAccount{
				ObjectMeta: metav1.ObjectMeta{GenerateName: "written-", Annotations: optInAnnotation("system:serviceaccount:nowhere:nobody")},
			}, metav1.CreateOptions{})
			if err == nil {
				_ = asWriter.Delete(ctx, sa.Name, metav1.DeleteOptions{})
			}
			assert.NoError(c, err, "the writer's create of an opted-in ServiceAccount")
		}, 10*time.Second, 100*time.Millisecond, "the role's holder is never allowed")
	})

	t.Run("a RoleBinding of credbroker-opt-in-writer in the owner's namespace grants nothing", func(t *testing.T) {
		_, err := spoke.Client.RbacV1().RoleBindings(ownerNS).Create(ctx, &rbacv1.RoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: "owner-opt-in-writer"},
			RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "credbroker-opt-in-writer"},
			Subjects:   []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: owner}},
		}, metav1.CreateOptions{})
		require.NoError(t, err)
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			ok, err := spoke.Allowed(ctx, rbacv1.Subject{Kind: rbacv1.UserKind, Name: owner}, authorizationv1.ResourceAttributes{
				Namespace: ownerNS, Verb: "set-opt-in", Group: "credbroker.io", Resource: "serviceaccounts",
			})
			if assert.NoError(c, err, "SubjectAccessReview") {
				assert.True(c, ok, "%s may set-opt-in serviceaccounts in %s", owner, ownerNS)
			}
		}, 10*time.Second, 50*time.Millisecond, "the RoleBinding never takes effect")
		_, err = asOwner.Create(ctx, &corev1.ServiceAccount{
			ObjectMeta: metav1.ObjectMeta{Name: "delegated", Annotations: optInAnnotation(victim.username())},
		}, metav1.CreateOptions{})
		refused(t, err)
	})

	t.Run("the victim's exchange that names no ServiceAccount still gets its own", func(t *testing.T) {
		resp, err := mint(audiences[2])
		if !assert.NoError(t, err) {
			assert.NotEqual(t, codes.FailedPrecondition, status.Code(err), "the victim is locked out")
			return
		}
		assert.Equal(t, "system:serviceaccount:"+victimNS+":victim", claims(t, resp.GetToken()).Sub)
	})
}

// bindUserEdit gives user, in namespace, the built-in edit role. The test API
// servers run no controller manager, which would aggregate edit's rules
// into it, so the user is bound to the roles edit aggregates:
// system:aggregate-to-edit (which may patch ServiceAccounts) and
// system:aggregate-to-view.
func bindUserEdit(t *testing.T, cluster *framework.Cluster, namespace, user string) {
	t.Helper()
	ctx := context.Background()
	for _, role := range []string{"edit", "system:aggregate-to-edit", "system:aggregate-to-view"} {
		_, err := cluster.Client.RbacV1().RoleBindings(namespace).Create(ctx, &rbacv1.RoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: user + "-" + strings.ReplaceAll(role, ":", "-")},
			RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role},
			Subjects:   []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: user}},
		}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		ok, err := cluster.Allowed(ctx, rbacv1.Subject{Kind: rbacv1.UserKind, Name: user},
			authorizationAttrs(namespace, "patch", "serviceaccounts"))
		if assert.NoError(c, err, "SubjectAccessReview") {
			assert.True(c, ok, "%s may patch serviceaccounts in %s", user, namespace)
		}
	}, 10*time.Second, 50*time.Millisecond, "%s may not patch ServiceAccounts in %s", user, namespace)
}

// authorizationAttrs asks about verb on resource in namespace, core group.
func authorizationAttrs(namespace, verb, resource string) authorizationv1.ResourceAttributes {
	return authorizationv1.ResourceAttributes{Namespace: namespace, Verb: verb, Resource: resource}
}
