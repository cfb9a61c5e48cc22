package e2e

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"

	"github.com/credbroker/credbroker/pkg/spoke"
	"github.com/credbroker/credbroker/test/framework"
)

// readObjects decodes every object of a deploy/ manifest.
func readObjects(t *testing.T, path string) []any {
	t.Helper()
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	docs := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(raw)))
	var objs []any
	for {
		doc, err := docs.Read()
		if errors.Is(err, io.EOF) {
			return objs
		}
		require.NoError(t, err)
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		obj, _, err := scheme.Codecs.UniversalDeserializer().Decode(doc, nil, nil)
		require.NoError(t, err, "%s", doc)
		objs = append(objs, obj)
	}
}

// applySpokeAdmission creates on spoke the admission policy and binding of
// deploy/spoke/admission.yaml, as shipped, and deletes them when the test
// ends.
func applySpokeAdmission(t *testing.T, spoke *framework.Cluster) {
	t.Helper()
	ctx := context.Background()
	client := spoke.Client.AdmissionregistrationV1()
	objs := readObjects(t, "../../deploy/spoke/admission.yaml")
	require.Len(t, objs, 2)
	for _, obj := range objs {
		var err error
		switch o := obj.(type) {
		case *admissionregistrationv1.ValidatingAdmissionPolicy:
			_, err = client.ValidatingAdmissionPolicies().Create(ctx, o, metav1.CreateOptions{})
			t.Cleanup(func() {
				_ = client.ValidatingAdmissionPolicies().Delete(context.Background(), o.Name, metav1.DeleteOptions{})
			})
		case *admissionregistrationv1.ValidatingAdmissionPolicyBinding:
			_, err = client.ValidatingAdmissionPolicyBindings().Create(ctx, o, metav1.CreateOptions{})
			t.Cleanup(func() {
				_ = client.ValidatingAdmissionPolicyBindings().Delete(context.Background(), o.Name, metav1.DeleteOptions{})
			})
		default:
			t.Fatalf("deploy/spoke/admission.yaml: no case for %T", obj)
		}
		require.NoError(t, err)
	}
}

// The agent's RBAC as shipped is what the e2e agents run with.
func TestAgentRBACMatchesDeploy(t *testing.T) {
	var roles []*rbacv1.ClusterRole
	for _, obj := range readObjects(t, "../../deploy/spoke/rbac.yaml") {
		if r, ok := obj.(*rbacv1.ClusterRole); ok {
			roles = append(roles, r)
		}
	}
	require.Len(t, roles, 1)
	assert.Equal(t, framework.AgentRules(), roles[0].Rules)
}

// agentClient acts on spoke as the agent's identity.
func agentClient(t *testing.T, spoke *framework.Cluster) kubernetes.Interface {
	t.Helper()
	user, groups := framework.ServiceAccountUser(framework.AgentNamespace, framework.AgentServiceAccount)
	cfg := rest.CopyConfig(spoke.Config)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: user, Groups: append(groups, "system:authenticated")}
	return kubernetes.NewForConfigOrDie(cfg)
}

func grantObject(name string, data map[string][]byte) *corev1.Secret {
	return &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{spoke.GrantLabel: "true"}},
		Type:       spoke.GrantType,
		Data:       data,
	}
}

// The attack: whoever holds the agent's identity uses its new power over
// Secrets to write or delete Secrets that are not grants.
func TestAgentAdmissionPolicyConfinesAgentToGrants(t *testing.T) {
	ctx := context.Background()
	cluster := env.Spokes[1]
	ns := uniqueName(t, "grants-policy")
	require.NoError(t, cluster.EnsureNamespace(ctx, ns))
	admin := cluster.Client.CoreV1().Secrets(ns)
	agent := agentClient(t, cluster).CoreV1().Secrets(ns)
	victim, err := admin.Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "db-password"},
		StringData: map[string]string{"password": "hunter2"},
	}, metav1.CreateOptions{})
	require.NoError(t, err)

	applySpokeAdmission(t, cluster)

	// A policy takes effect once the API server has loaded it.
	require.Eventually(t, func() bool {
		s, err := agent.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{GenerateName: "probe-"}}, metav1.CreateOptions{})
		if err == nil {
			_ = admin.Delete(ctx, s.Name, metav1.DeleteOptions{})
			return false
		}
		return apierrors.IsForbidden(err)
	}, 10*time.Second, 50*time.Millisecond, "the agent still creates Secrets that are not grants")

	refused := func(t *testing.T, err error) {
		t.Helper()
		require.Error(t, err)
		assert.True(t, apierrors.IsForbidden(err), "%v", err)
		assert.Contains(t, err.Error(), "ValidatingAdmissionPolicy 'credbroker-agent-grants'")
	}
	t.Run("the agent may not create a Secret of another type", func(t *testing.T) {
		for _, typ := range []corev1.SecretType{corev1.SecretTypeOpaque, corev1.SecretTypeServiceAccountToken, corev1.SecretTypeDockerConfigJson} {
			s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "not-a-grant"}, Type: typ}
			switch typ {
			case corev1.SecretTypeServiceAccountToken:
				s.Annotations = map[string]string{corev1.ServiceAccountNameKey: "default"}
			case corev1.SecretTypeDockerConfigJson:
				s.Data = map[string][]byte{corev1.DockerConfigJsonKey: []byte(`{"auths":{}}`)}
			}
			_, err := agent.Create(ctx, s, metav1.CreateOptions{})
			refused(t, err)
		}
	})
	t.Run("the agent may not put data in a grant", func(t *testing.T) {
		_, err := agent.Create(ctx, grantObject("with-data", map[string][]byte{"k": []byte("v")}), metav1.CreateOptions{})
		refused(t, err)
	})
	t.Run("the agent may not patch or delete a Secret that is not a grant", func(t *testing.T) {
		_, err := agent.Patch(ctx, victim.Name, types.MergePatchType, []byte(`{"data":{"password":"b3duZWQ="}}`), metav1.PatchOptions{})
		refused(t, err)
		err = agent.Delete(ctx, victim.Name, metav1.DeleteOptions{})
		refused(t, err)
		got, err := admin.Get(ctx, victim.Name, metav1.GetOptions{})
		require.NoError(t, err)
		assert.Equal(t, "hunter2", string(got.Data["password"]))
	})
	t.Run("the agent may create, patch and delete a grant", func(t *testing.T) {
		g, err := agent.Create(ctx, grantObject("a-grant", nil), metav1.CreateOptions{})
		require.NoError(t, err)
		_, err = agent.Patch(ctx, g.Name, types.MergePatchType,
			[]byte(`{"metadata":{"annotations":{"`+spoke.GrantCredentialIDAnnotation+`":"JTI=x"}}}`), metav1.PatchOptions{})
		require.NoError(t, err)
		_, err = agent.Patch(ctx, g.Name, types.MergePatchType, []byte(`{"data":{"k":"dg=="}}`), metav1.PatchOptions{})
		refused(t, err)
		require.NoError(t, agent.Delete(ctx, g.Name, metav1.DeleteOptions{}))
	})
	t.Run("everyone else is left alone", func(t *testing.T) {
		s, err := admin.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{GenerateName: "admin-"}}, metav1.CreateOptions{})
		require.NoError(t, err)
		require.NoError(t, admin.Delete(ctx, s.Name, metav1.DeleteOptions{}))
	})
}
