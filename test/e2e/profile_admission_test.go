package e2e

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	clientcmdv1 "k8s.io/client-go/tools/clientcmd/api/v1"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"
	"sigs.k8s.io/cluster-inventory-api/pkg/access"

	"github.com/credbroker/credbroker/pkg/plugin"
	"github.com/credbroker/credbroker/pkg/publish"
	"github.com/credbroker/credbroker/test/framework"
)

const (
	additionalArgsExtension = "clusterprofiles.multicluster.x-k8s.io/exec/additional-args"
	additionalEnvsExtension = "clusterprofiles.multicluster.x-k8s.io/exec/additional-envs"
)

// execExtension is the exec extension that names the ClusterProfile
// namespace/name, as the plugin reads it.
func execExtension(namespace, name string) clientcmdv1.NamedExtension {
	raw, _ := json.Marshal(plugin.ExecConfig{ClusterProfile: &plugin.Reference{Namespace: namespace, Name: name}})
	return clientcmdv1.NamedExtension{Name: publish.ExecExtensionName, Extension: runtime.RawExtension{Raw: raw}}
}

func rawExtension(name, value string) clientcmdv1.NamedExtension {
	return clientcmdv1.NamedExtension{Name: name, Extension: runtime.RawExtension{Raw: []byte(value)}}
}

// accessFor builds, with cluster-inventory-api's pkg/access and a provider
// file that names the plugin, the client that a consumer holding token
// builds for cp.
func accessFor(t *testing.T, token string, cp *v1alpha1.ClusterProfile) (kubernetes.Interface, error) {
	t.Helper()
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(token), 0o600))
	cfg := access.New([]access.Provider{{
		Name: plugin.Name,
		ExecConfig: &clientcmdapi.ExecConfig{
			APIVersion: "client.authentication.k8s.io/v1", Command: pluginBin, ProvideClusterInfo: true,
			Args: []string{"--broker-address", deployment.Broker.ExchangeAddr(), "--ca-file", deployment.CAFile, "--token-file", tokenFile},
		},
	}})
	rc, err := cfg.BuildConfigFromCP(cp)
	if err != nil {
		return nil, err
	}
	return kubernetes.NewForConfig(rc)
}

// The attack: a cluster manager of another inventory, who may write only
// the ClusterProfiles (and their status) of its own namespace, publishes
// in the status of its profile X the server and CA of prod and the exec
// extension {"clusterProfile": {"namespace": "fleet", "name": "prod"}}. A
// fleet controller with hub RBAC on prod that builds a client "for X" with
// pkg/access then works on prod with a prod token, and every pin of the
// plugin passes, since they compare with prod's own answer.
// deploy/hub/admission.yaml refuses, on clusterprofiles/status, an exec
// extension that names another ClusterProfile than the object itself, and
// profile-sourced plugin arguments or environment (KEP-5339) on
// credbroker's entry.
func TestProfileCannotNameAnotherProfilesExecConfig(t *testing.T) {
	ctx := context.Background()
	prod := env.Spokes[0]
	// A consumer of prod: hub RBAC on fleet/<prod> and an opted-in spoke
	// ServiceAccount that may list namespaces there.
	c := newConsumer(t, "credbroker", prod.Name)
	spokeNS := optIn(t, prod, "reader", c.username())
	require.NoError(t, prod.Grant(ctx, "", framework.ServiceAccountSubject(spokeNS, "reader"), []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"namespaces"}, Verbs: []string{"list"}},
	}))

	// The other inventory's cluster manager: ClusterProfiles and their
	// status in its own namespace, nothing more.
	ns := uniqueName(t, "inventory")
	writer := "e2e-other-cluster-manager"
	require.NoError(t, env.Hub.Grant(ctx, ns, rbacv1.Subject{Kind: rbacv1.UserKind, Name: writer}, []rbacv1.PolicyRule{{
		APIGroups: []string{v1alpha1.GroupVersion.Group}, Resources: []string{"clusterprofiles", "clusterprofiles/status"},
		Verbs: []string{"get", "create", "update", "patch"},
	}}))
	profiles := inventoryAs(t, writer).ApisV1alpha1().ClusterProfiles(ns)
	create := func(name string) *v1alpha1.ClusterProfile {
		cp, err := profiles.Create(ctx, &v1alpha1.ClusterProfile{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
			Spec:       v1alpha1.ClusterProfileSpec{DisplayName: name, ClusterManager: v1alpha1.ClusterManager{Name: "other-inventory"}},
		}, metav1.CreateOptions{})
		require.NoError(t, err)
		return cp
	}
	entry := func(exts ...clientcmdv1.NamedExtension) v1alpha1.AccessProvider {
		return v1alpha1.AccessProvider{Name: plugin.Name, Cluster: clientcmdv1.Cluster{
			Server: prod.Server, CertificateAuthorityData: prod.CAData, Extensions: exts,
		}}
	}
	writeStatus := func(name string, edit func(*v1alpha1.ClusterProfileStatus)) (*v1alpha1.ClusterProfile, error) {
		cp, err := profiles.Get(ctx, name, metav1.GetOptions{})
		require.NoError(t, err)
		edit(&cp.Status)
		return profiles.UpdateStatus(ctx, cp, metav1.UpdateOptions{})
	}
	namesProd := execExtension(framework.FleetNamespace, prod.Name)

	// Written before the policy is installed: its unchanged entries do not
	// block later status writes.
	legacy := create("legacy")
	_, err := writeStatus(legacy.Name, func(s *v1alpha1.ClusterProfileStatus) {
		s.AccessProviders = []v1alpha1.AccessProvider{entry(namesProd)}
	})
	require.NoError(t, err)

	probe := create("probe")
	applyFile(t, "../../deploy/hub/admission.yaml")
	var probeErr error
	enforced := assert.Eventually(t, func() bool {
		_, probeErr = writeStatus(probe.Name, func(s *v1alpha1.ClusterProfileStatus) {
			s.AccessProviders = []v1alpha1.AccessProvider{entry(namesProd)}
		})
		if probeErr == nil {
			_, _ = writeStatus(probe.Name, func(s *v1alpha1.ClusterProfileStatus) { s.AccessProviders = nil })
		}
		return apierrors.IsForbidden(probeErr) || apierrors.IsInvalid(probeErr)
	}, 30*time.Second, 200*time.Millisecond, "the policy is never enforced")
	t.Logf("policy enforced: %v (last probe: %v)", enforced, probeErr)

	refused := func(t *testing.T, err error, want string) {
		t.Helper()
		require.Error(t, err, "the status write was accepted")
		assert.True(t, apierrors.IsForbidden(err) || apierrors.IsInvalid(err), "%v", err)
		assert.Contains(t, err.Error(), "ValidatingAdmissionPolicy 'credbroker-profile-access'")
		assert.Contains(t, err.Error(), want)
	}

	t.Run("X's credbroker entry cannot name prod", func(t *testing.T) {
		x := create("x")
		written, err := writeStatus(x.Name, func(s *v1alpha1.ClusterProfileStatus) {
			s.AccessProviders = []v1alpha1.AccessProvider{entry(namesProd)}
		})
		if err == nil {
			// The attack worked: a client "for X" reaches prod.
			client, err := accessFor(t, c.token, written)
			require.NoError(t, err)
			list, err := client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
			t.Errorf("%s/x published the exec config of %s/%s; a client built for %s/x listed namespaces on %s: %d namespaces, error %v",
				ns, framework.FleetNamespace, prod.Name, ns, prod.Name, len(list.Items), err)
			return
		}
		refused(t, err, "names another ClusterProfile")
		assert.Contains(t, err.Error(), framework.FleetNamespace+"/"+prod.Name)
		got, err := profiles.Get(ctx, x.Name, metav1.GetOptions{})
		require.NoError(t, err)
		_, err = accessFor(t, c.token, got)
		assert.ErrorContains(t, err, "no matching cluster accessor", "X has no access provider for the consumer to use")
	})

	t.Run("no other provider's exec extension, nor a deprecated credentialProviders entry, names prod", func(t *testing.T) {
		x := create("x-other-entry")
		_, err := writeStatus(x.Name, func(s *v1alpha1.ClusterProfileStatus) {
			e := entry(namesProd)
			e.Name = "renamed-credbroker"
			s.AccessProviders = []v1alpha1.AccessProvider{e}
		})
		refused(t, err, "names another ClusterProfile")
		_, err = writeStatus(x.Name, func(s *v1alpha1.ClusterProfileStatus) {
			e := entry(execExtension(ns, x.Name), namesProd)
			s.AccessProviders = []v1alpha1.AccessProvider{e}
		})
		refused(t, err, "names another ClusterProfile")
		_, err = writeStatus(x.Name, func(s *v1alpha1.ClusterProfileStatus) {
			s.CredentialProviders = []v1alpha1.CredentialProvider{entry(namesProd)}
		})
		refused(t, err, "names another ClusterProfile")
		_, err = writeStatus(x.Name, func(s *v1alpha1.ClusterProfileStatus) {
			s.AccessProviders = []v1alpha1.AccessProvider{entry(rawExtension(publish.ExecExtensionName, `{"clusterProfile":"fleet/prod"}`))}
		})
		assert.Error(t, err, "a clusterProfile that is not an object")
	})

	t.Run("credbroker's entry carries no profile-sourced plugin arguments or environment", func(t *testing.T) {
		x := create("x-args")
		// KEP-5339 gives these extensions as lists, which the CRD of
		// cluster-inventory-api v0.1.0 refuses (it types every extension as
		// an object). The policy refuses them by name, whatever their shape,
		// for a CRD that accepts lists.
		for _, ext := range []clientcmdv1.NamedExtension{
			rawExtension(additionalArgsExtension, `{"args":["--broker-address=evil.example:443","--ca-file=/etc/ssl/certs/ca-certificates.crt"]}`),
			rawExtension(additionalEnvsExtension, `{"envs":[{"name":"HTTPS_PROXY","value":"http://evil.example:3128"}]}`),
		} {
			// On the entry named credbroker, and on any entry with
			// credbroker's exec extension.
			_, err := writeStatus(x.Name, func(s *v1alpha1.ClusterProfileStatus) {
				s.AccessProviders = []v1alpha1.AccessProvider{entry(ext)}
			})
			refused(t, err, ext.Name)
			_, err = writeStatus(x.Name, func(s *v1alpha1.ClusterProfileStatus) {
				e := entry(execExtension(ns, x.Name), ext)
				e.Name = "renamed-credbroker"
				s.AccessProviders = []v1alpha1.AccessProvider{e}
			})
			refused(t, err, ext.Name)
		}
	})

	t.Run("X's own name, and other providers' extensions, are the manager's to write", func(t *testing.T) {
		x := create("x-own")
		other := v1alpha1.AccessProvider{Name: "cluster-manager", Cluster: clientcmdv1.Cluster{
			Server:     "https://manager.example:6443",
			Extensions: []clientcmdv1.NamedExtension{rawExtension(additionalArgsExtension, `{"args":["--region=eu"]}`)},
		}}
		written, err := writeStatus(x.Name, func(s *v1alpha1.ClusterProfileStatus) {
			s.AccessProviders = []v1alpha1.AccessProvider{entry(execExtension(ns, x.Name)), other}
		})
		require.NoError(t, err)
		require.Len(t, written.Status.AccessProviders, 2)
	})

	t.Run("a status written before the policy stays writable, but its entry cannot be rewritten to name another", func(t *testing.T) {
		_, err := writeStatus(legacy.Name, func(s *v1alpha1.ClusterProfileStatus) {
			s.Conditions = []metav1.Condition{{Type: "ControlPlaneHealthy", Status: metav1.ConditionTrue, Reason: "Healthy", LastTransitionTime: metav1.Now()}}
		})
		require.NoError(t, err, "an unchanged entry does not block other status writes")
		_, err = writeStatus(legacy.Name, func(s *v1alpha1.ClusterProfileStatus) {
			s.AccessProviders[0].Cluster.Extensions = []clientcmdv1.NamedExtension{execExtension(framework.FleetNamespace, env.Spokes[1].Name)}
		})
		refused(t, err, "names another ClusterProfile")
	})

	t.Run("the broker's own publishing passes", func(t *testing.T) {
		name := uniqueName(t, "published-under-policy")
		_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, nil)
		require.NoError(t, err)
		b, _ := startPublisher(t, name, "", nil)
		startAdvertisingAgent(t, prod, name, b)
		framework.Eventually(t, 30*time.Second, 100*time.Millisecond, "the broker to publish its access provider under the policy", func(c assert.TestingT) {
			cp, err := env.Hub.Inventory.ApisV1alpha1().ClusterProfiles(framework.FleetNamespace).Get(ctx, name, metav1.GetOptions{})
			require.NoError(t, err)
			assert.NotNil(c, findProvider(cp, plugin.Name), "%s provider in %s", plugin.Name, statusOf(cp))
		})
	})
}
