package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	clientcmdv1 "k8s.io/client-go/tools/clientcmd/api/v1"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"
	"sigs.k8s.io/cluster-inventory-api/pkg/access"

	"github.com/credbroker/credbroker/pkg/agent"
	"github.com/credbroker/credbroker/pkg/broker"
	"github.com/credbroker/credbroker/pkg/plugin"
	"github.com/credbroker/credbroker/pkg/publish"
	"github.com/credbroker/credbroker/test/framework"
)

// startPublisher runs a broker with the deployment's config that publishes
// its access provider into ClusterProfiles, holding the Lease default/lease
// as identity (the broker's default identity when empty); tune may change
// more. The returned stop, which the test's end also calls, stops it once.
func startPublisher(t *testing.T, lease, identity string, tune func(*broker.Config)) (*broker.Broker, func()) {
	t.Helper()
	cfg := deployment.BrokerConfig()
	cfg.PublishAccessProvider = true
	cfg.PublishLeaseNamespace, cfg.PublishLeaseName = "default", lease
	if identity != "" {
		cfg.PublishIdentity = identity
	}
	cfg.PublishDisconnectGrace = time.Second
	if tune != nil {
		tune(&cfg)
	}
	b, err := broker.New(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- b.Run(ctx) }()
	stop := sync.OnceFunc(func() {
		cancel()
		require.NoError(t, <-done)
	})
	t.Cleanup(stop)
	return b, stop
}

// startAdvertisingAgent starts an agent on spoke for the ClusterProfile
// fleet/name that advertises spoke's server and CA, connected to the
// deployment's replicas (through which the framework revokes the agent's
// grants when it stops) and to the publishers. The returned stop, which
// the test's end also calls, stops it once.
func startAdvertisingAgent(t *testing.T, spoke *framework.Cluster, name string, publishers ...*broker.Broker) func() {
	t.Helper()
	stop, err := deployment.StartAgentWith(context.Background(), spoke, framework.AgentOptions{
		ID: framework.AgentID(name), Cluster: framework.FleetNamespace + "/" + name,
		Tune: func(c *agent.Config) {
			for _, b := range publishers {
				c.BrokerAddresses = append(c.BrokerAddresses, b.AgentAddr())
			}
			c.AdvertiseServer, c.AdvertiseCAData = spoke.Server, spoke.CAData
		},
	})
	require.NoError(t, err)
	once := sync.OnceFunc(stop)
	t.Cleanup(once)
	return once
}

// The broker, with --publish-access-provider, writes its access provider
// into a ClusterProfile whose status starts empty, from what the agent
// advertises; pkg/access then builds a working spoke client from it alone.
// The cluster manager's own entry and condition survive every write, and
// the broker's condition turns False when the agent goes.
func TestBrokerPublishesAccessProvider(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	name := uniqueName(t, "published")
	profiles := env.Hub.Inventory.ApisV1alpha1().ClusterProfiles(framework.FleetNamespace)

	// The cluster manager's status: another provider and another condition.
	cp, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, nil)
	require.NoError(t, err)
	require.Empty(t, cp.Status.AccessProviders)
	other := v1alpha1.AccessProvider{Name: "cluster-manager", Cluster: clientcmdv1.Cluster{Server: "https://manager.example:6443"}}
	cp.Status.AccessProviders = []v1alpha1.AccessProvider{other}
	cp.Status.Conditions = []metav1.Condition{{
		Type: "ControlPlaneHealthy", Status: metav1.ConditionTrue, Reason: "Healthy", Message: "written by the cluster manager",
		LastTransitionTime: metav1.Now(),
	}}
	_, err = profiles.UpdateStatus(ctx, cp, metav1.UpdateOptions{FieldManager: "cluster-manager"})
	require.NoError(t, err)

	// A broker that publishes.
	b, _ := startPublisher(t, name, "", nil)
	stopAgent := startAdvertisingAgent(t, spoke, name, b)

	get := func() *v1alpha1.ClusterProfile {
		cp, err := profiles.Get(ctx, name, metav1.GetOptions{})
		require.NoError(t, err)
		return cp
	}
	var published *v1alpha1.ClusterProfile
	framework.Eventually(t, 30*time.Second, 100*time.Millisecond, "the broker to publish its access provider", func(ct assert.TestingT) {
		published = get()
		c := findCondition(published, publish.ConditionType)
		assert.True(ct, findProvider(published, plugin.Name) != nil && c != nil && c.Status == metav1.ConditionTrue,
			"%s provider and %s=True in %s", plugin.Name, publish.ConditionType, statusOf(published))
	})
	entry := findProvider(published, plugin.Name)
	assert.Equal(t, spoke.Server, entry.Cluster.Server)
	assert.Equal(t, spoke.CAData, entry.Cluster.CertificateAuthorityData)
	require.Len(t, entry.Cluster.Extensions, 1)
	assert.Equal(t, publish.ExecExtensionName, entry.Cluster.Extensions[0].Name)
	assert.JSONEq(t, `{"clusterProfile":{"namespace":"`+framework.FleetNamespace+`","name":"`+name+`"}}`, string(entry.Cluster.Extensions[0].Extension.Raw))
	assertManagerEntriesSurvive(t, published, other)

	// A consumer with nothing but a provider file naming the plugin.
	c := newConsumer(t, "credbroker", name)
	ns := optIn(t, spoke, "reader", c.username())
	require.NoError(t, spoke.Grant(ctx, "", framework.ServiceAccountSubject(ns, "reader"), []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"namespaces"}, Verbs: []string{"list"}},
	}))
	client := providerFileClient(t, b, c, published)
	nsList, err := client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	assert.NotEmpty(t, nsList.Items)

	// The agent goes: the condition turns False; the rest stays.
	stopAgent()
	var gone *v1alpha1.ClusterProfile
	framework.Eventually(t, 30*time.Second, 100*time.Millisecond, "the condition to turn False when the agent goes", func(ct assert.TestingT) {
		gone = get()
		c := findCondition(gone, publish.ConditionType)
		assert.True(ct, c != nil && c.Status == metav1.ConditionFalse, "%s=False in %s", publish.ConditionType, statusOf(gone))
	})
	assert.Equal(t, publish.ReasonNoAgentConnected, findCondition(gone, publish.ConditionType).Reason)
	assertManagerEntriesSurvive(t, gone, other)
	assert.NotNil(t, findProvider(gone, plugin.Name), "the last server and CA stay; the condition says they do not work now")
}

// providerFileClient builds a spoke client for c from the published
// ClusterProfile cp, the way a consumer of pkg/access does: from a
// provider file that names the plugin, with b's exchange address.
func providerFileClient(t *testing.T, b *broker.Broker, c consumer, cp *v1alpha1.ClusterProfile) kubernetes.Interface {
	t.Helper()
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(c.token), 0o600))
	raw, err := json.Marshal(access.Config{Providers: []access.Provider{{
		Name: plugin.Name,
		ExecConfig: &clientcmdapi.ExecConfig{
			APIVersion: "client.authentication.k8s.io/v1", Command: pluginBin, ProvideClusterInfo: true,
			Args: []string{"--broker-address", b.ExchangeAddr(), "--ca-file", deployment.CAFile, "--token-file", tokenFile},
		},
	}}})
	require.NoError(t, err)
	providerFile := filepath.Join(dir, "providers.json")
	require.NoError(t, os.WriteFile(providerFile, raw, 0o600))
	loaded, err := access.NewFromFile(providerFile)
	require.NoError(t, err)
	restConfig, err := loaded.BuildConfigFromCP(cp)
	require.NoError(t, err)
	client, err := kubernetes.NewForConfig(restConfig)
	require.NoError(t, err)
	return client
}

func assertManagerEntriesSurvive(t *testing.T, cp *v1alpha1.ClusterProfile, other v1alpha1.AccessProvider) {
	t.Helper()
	got := findProvider(cp, other.Name)
	if assert.NotNil(t, got, "the cluster manager's access provider survives") {
		assert.Equal(t, other.Cluster.Server, got.Cluster.Server)
	}
	c := findCondition(cp, "ControlPlaneHealthy")
	if assert.NotNil(t, c, "the cluster manager's condition survives") {
		assert.Equal(t, "written by the cluster manager", c.Message)
	}
}

// statusOf is what cp's status says, its conditions and access providers,
// for the message of a wait that failed.
func statusOf(cp *v1alpha1.ClusterProfile) string {
	var b strings.Builder
	fmt.Fprintf(&b, "ClusterProfile %s/%s at resourceVersion %s:", cp.Namespace, cp.Name, cp.ResourceVersion)
	for _, c := range cp.Status.Conditions {
		fmt.Fprintf(&b, " condition %s=%s (%s: %s);", c.Type, c.Status, c.Reason, c.Message)
	}
	for _, p := range cp.Status.AccessProviders {
		fmt.Fprintf(&b, " access provider %s: %s;", p.Name, p.Cluster.Server)
	}
	return b.String()
}

func findProvider(cp *v1alpha1.ClusterProfile, name string) *v1alpha1.AccessProvider {
	for i := range cp.Status.AccessProviders {
		if cp.Status.AccessProviders[i].Name == name {
			return &cp.Status.AccessProviders[i]
		}
	}
	return nil
}

func findCondition(cp *v1alpha1.ClusterProfile, typ string) *metav1.Condition {
	for i := range cp.Status.Conditions {
		if cp.Status.Conditions[i].Type == typ {
			return &cp.Status.Conditions[i]
		}
	}
	return nil
}
