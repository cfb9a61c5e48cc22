package e2e

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	clientcmdv1 "k8s.io/client-go/tools/clientcmd/api/v1"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"
	inventory "sigs.k8s.io/cluster-inventory-api/client/clientset/versioned"

	"github.com/credbroker/credbroker/pkg/plugin"
	"github.com/credbroker/credbroker/test/framework"
)

// applyFile creates on the hub every object of a deploy/ manifest, as it is
// shipped, and deletes them when the test ends.
func applyFile(t *testing.T, path string) {
	t.Helper()
	ctx := context.Background()
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	// The API server stops enforcing a deleted policy a moment after the
	// delete. A test after this one writes ClusterProfile statuses that
	// deploy/hub/admission.yaml refuses, so wait for the end of
	// credbroker-profile-access (this cleanup runs after the deletes).
	var profileAccess bool
	t.Cleanup(func() {
		if profileAccess {
			assert.NoError(t, waitForProfileAccessPolicyGone(ctx), "credbroker-profile-access is still enforced after the test")
		}
	})
	docs := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(raw)))
	for {
		doc, err := docs.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err)
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		obj, _, err := scheme.Codecs.UniversalDeserializer().Decode(doc, nil, nil)
		require.NoError(t, err, "%s", doc)
		client := env.Hub.Client
		switch o := obj.(type) {
		case *admissionregistrationv1.ValidatingAdmissionPolicy:
			profileAccess = profileAccess || o.Name == "credbroker-profile-access"
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

// inventoryAs is a ClusterProfile client that acts as user.
func inventoryAs(t *testing.T, user string) inventory.Interface {
	t.Helper()
	cfg := rest.CopyConfig(env.Hub.Config)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: user, Groups: []string{"system:authenticated"}}
	c, err := inventory.NewForConfig(cfg)
	require.NoError(t, err)
	return c
}

// waitForProfileAccessPolicyGone waits until the hub accepts, in a dry run,
// a status write of the first spoke's ClusterProfile whose credbroker entry
// names another ClusterProfile, which credbroker-profile-access refuses.
func waitForProfileAccessPolicyGone(ctx context.Context) error {
	profiles := env.Hub.Inventory.ApisV1alpha1().ClusterProfiles(framework.FleetNamespace)
	var last error
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		cp, err := profiles.Get(ctx, env.Spokes[0].Name, metav1.GetOptions{})
		if err != nil {
			last = err
			return false, nil
		}
		spoke := env.Spokes[0]
		cp.Status.AccessProviders = []v1alpha1.AccessProvider{{Name: plugin.Name, Cluster: clientcmdv1.Cluster{
			Server: spoke.Server, CertificateAuthorityData: spoke.CAData,
			Extensions: []clientcmdv1.NamedExtension{execExtension(framework.FleetNamespace, env.Spokes[1].Name)},
		}}}
		_, last = profiles.UpdateStatus(ctx, cp, metav1.UpdateOptions{DryRun: []string{metav1.DryRunAll}})
		return last == nil, nil
	})
	if err != nil {
		return fmt.Errorf("the dry-run status write is still refused (last: %v): %w", last, err)
	}
	return nil
}

// deploy/hub/admission.yaml lets only identities granted
// set-agent-spiffe-id write the agent ID annotation of a ClusterProfile,
// while anyone else may still manage ClusterProfiles without it.
func TestOnlyNamedIdentitiesSetTheAgentID(t *testing.T) {
	ctx := context.Background()
	ns := uniqueName(t, "admission")
	require.NoError(t, env.Hub.EnsureNamespace(ctx, ns))
	applyFile(t, "../../deploy/hub/admission.yaml")

	// Both may manage ClusterProfiles in ns; only the cluster manager may
	// choose their agent.
	editor, manager := "e2e-editor", "e2e-cluster-manager"
	edit := rbacv1.PolicyRule{APIGroups: []string{v1alpha1.GroupVersion.Group}, Resources: []string{"clusterprofiles"},
		Verbs: []string{"get", "create", "update", "patch"}}
	for _, user := range []string{editor, manager} {
		require.NoError(t, env.Hub.Grant(ctx, ns, rbacv1.Subject{Kind: rbacv1.UserKind, Name: user}, []rbacv1.PolicyRule{edit}))
	}
	require.NoError(t, env.Hub.Grant(ctx, ns, rbacv1.Subject{Kind: rbacv1.UserKind, Name: manager}, []rbacv1.PolicyRule{{
		APIGroups: []string{v1alpha1.GroupVersion.Group}, Resources: []string{"clusterprofiles"}, Verbs: []string{"set-agent-spiffe-id"},
	}}))

	newProfile := func(name string, annotated bool) *v1alpha1.ClusterProfile {
		cp := &v1alpha1.ClusterProfile{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
			Spec:       v1alpha1.ClusterProfileSpec{DisplayName: name, ClusterManager: v1alpha1.ClusterManager{Name: framework.ClusterManagerName}},
		}
		if annotated {
			cp.Annotations = map[string]string{"credbroker.io/agent-spiffe-id": "spiffe://" + framework.TrustDomain + "/agents/" + name}
		}
		return cp
	}
	asEditor := inventoryAs(t, editor).ApisV1alpha1().ClusterProfiles(ns)
	asManager := inventoryAs(t, manager).ApisV1alpha1().ClusterProfiles(ns)

	// The API server starts enforcing a new policy within a few seconds.
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		_, err := asEditor.Create(ctx, newProfile(uniqueName(t, "probe"), true), metav1.CreateOptions{})
		assert.True(c, apierrors.IsForbidden(err) || apierrors.IsInvalid(err), "the editor's create of an annotated ClusterProfile: want Forbidden or Invalid, got %v", err)
	}, 30*time.Second, 200*time.Millisecond, "the policy is never enforced")

	t.Run("the editor cannot set the annotation on create", func(t *testing.T) {
		_, err := asEditor.Create(ctx, newProfile("edited-1", true), metav1.CreateOptions{})
		require.Error(t, err)
		assert.Contains(t, err.Error(), "only identities granted set-agent-spiffe-id")
	})

	t.Run("the editor manages ClusterProfiles without it", func(t *testing.T) {
		_, err := asEditor.Create(ctx, newProfile("edited-2", false), metav1.CreateOptions{})
		require.NoError(t, err)
		_, err = asEditor.Patch(ctx, "edited-2", types.MergePatchType, []byte(`{"metadata":{"labels":{"team":"a"}}}`), metav1.PatchOptions{})
		require.NoError(t, err)
	})

	t.Run("the editor cannot add the annotation later", func(t *testing.T) {
		_, err := asEditor.Patch(ctx, "edited-2", types.MergePatchType,
			[]byte(`{"metadata":{"annotations":{"credbroker.io/agent-spiffe-id":"spiffe://`+framework.TrustDomain+`/agents/x"}}}`), metav1.PatchOptions{})
		require.Error(t, err)
		assert.Contains(t, err.Error(), "only identities granted set-agent-spiffe-id")
	})

	t.Run("the cluster manager sets it, and the editor can neither change nor remove it", func(t *testing.T) {
		_, err := asManager.Create(ctx, newProfile("managed-1", true), metav1.CreateOptions{})
		require.NoError(t, err)
		_, err = asEditor.Patch(ctx, "managed-1", types.MergePatchType,
			[]byte(`{"metadata":{"annotations":{"credbroker.io/agent-spiffe-id":"spiffe://`+framework.TrustDomain+`/agents/other"}}}`), metav1.PatchOptions{})
		assert.ErrorContains(t, err, "only identities granted set-agent-spiffe-id")
		_, err = asEditor.Patch(ctx, "managed-1", types.MergePatchType,
			[]byte(`{"metadata":{"annotations":{"credbroker.io/agent-spiffe-id":null}}}`), metav1.PatchOptions{})
		assert.ErrorContains(t, err, "only identities granted set-agent-spiffe-id")
		// Other edits that leave the annotation alone are the editor's to make.
		_, err = asEditor.Patch(ctx, "managed-1", types.MergePatchType, []byte(`{"metadata":{"labels":{"team":"b"}}}`), metav1.PatchOptions{})
		require.NoError(t, err)
		_, err = asManager.Patch(ctx, "managed-1", types.MergePatchType,
			[]byte(`{"metadata":{"annotations":{"credbroker.io/agent-spiffe-id":null}}}`), metav1.PatchOptions{})
		require.NoError(t, err)
	})
}
