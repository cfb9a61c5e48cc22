package e2e

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"

	"github.com/credbroker/credbroker/pkg/agent"
	"github.com/credbroker/credbroker/pkg/broker"
	"github.com/credbroker/credbroker/pkg/publish"
	"github.com/credbroker/credbroker/test/framework"
)

// readyzFault stands in front of a spoke API server: while failing is set,
// it answers /readyz as a kube-apiserver that has lost etcd does, and it
// passes every other request, and /readyz otherwise, to the spoke.
type readyzFault struct {
	srv     *httptest.Server
	failing atomic.Bool
}

func newReadyzFault(t *testing.T, spoke *framework.Cluster) *readyzFault {
	t.Helper()
	target, err := url.Parse(spoke.Server)
	require.NoError(t, err)
	roots := x509.NewCertPool()
	require.True(t, roots.AppendCertsFromPEM(spoke.CAData))
	proxy := httputil.NewSingleHostReverseProxy(target)
	proxy.Transport = &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}}
	proxy.FlushInterval = -1 // watches
	f := &readyzFault{}
	f.srv = httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/readyz" && f.failing.Load() {
			http.Error(w, "[+]ping ok\n[+]log ok\n[-]etcd failed: reason withheld\n[+]informer-sync ok\nreadyz check failed", http.StatusInternalServerError)
			return
		}
		proxy.ServeHTTP(w, r)
	}))
	t.Cleanup(f.srv.Close)
	return f
}

// config is a spoke client config through the fault, with the same bearer
// token as base.
func (f *readyzFault) config(base *rest.Config) *rest.Config {
	return &rest.Config{Host: f.srv.URL, BearerToken: base.BearerToken, TLSClientConfig: rest.TLSClientConfig{
		CAData: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: f.srv.Certificate().Raw}),
	}}
}

// engaged is the test by which multicluster-runtime's cluster-inventory-api
// provider engages a cluster: its ControlPlaneHealthy condition is True.
func engaged(cp *v1alpha1.ClusterProfile) bool {
	return meta.IsStatusConditionTrue(cp.Status.Conditions, v1alpha1.ClusterConditionControlPlaneHealthy)
}

// With --publish-control-plane-healthy, the broker keeps ControlPlaneHealthy
// from what the agents see of the spoke's /readyz: a controller that gates
// on it, as multicluster-runtime does, engages the cluster once an agent
// with a healthy spoke connects, reaches the spoke through pkg/access, and
// lets the cluster go when /readyz fails or the agent leaves. Where a
// cluster manager writes the condition, the broker leaves it alone.
func TestControlPlaneHealthyForMulticlusterRuntime(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	profiles := env.Hub.Inventory.ApisV1alpha1().ClusterProfiles(framework.FleetNamespace)
	get := func(name string) *v1alpha1.ClusterProfile {
		cp, err := profiles.Get(ctx, name, metav1.GetOptions{})
		require.NoError(t, err)
		return cp
	}
	name := uniqueName(t, "healthy")
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, nil)
	require.NoError(t, err)
	// A ClusterProfile whose cluster manager writes ControlPlaneHealthy.
	managed := uniqueName(t, "managed")
	cp, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, managed, nil)
	require.NoError(t, err)
	cp.Status.Conditions = []metav1.Condition{{
		Type: v1alpha1.ClusterConditionControlPlaneHealthy, Status: metav1.ConditionFalse, Reason: "Maintenance",
		Message: "written by the cluster manager", LastTransitionTime: metav1.Now(),
	}}
	_, err = profiles.UpdateStatus(ctx, cp, metav1.UpdateOptions{FieldManager: "cluster-manager"})
	require.NoError(t, err)

	b, _ := startPublisher(t, name, "", func(c *broker.Config) { c.PublishControlPlaneHealthy = true })
	fault := newReadyzFault(t, spoke)
	stopAgent := startHealthReportingAgent(t, spoke, name, fault, b)
	startHealthReportingAgent(t, spoke, managed, nil, b)

	// An agent with a healthy spoke connects: the cluster is engaged, and
	// pkg/access reaches it.
	var healthy *v1alpha1.ClusterProfile
	framework.Eventually(t, 30*time.Second, 100*time.Millisecond, "ControlPlaneHealthy to turn True when an agent with a healthy spoke connects", func(c assert.TestingT) {
		healthy = get(name)
		assert.True(c, engaged(healthy), "ControlPlaneHealthy=True in %s", statusOf(healthy))
	})
	assert.Equal(t, publish.ReasonSpokeReady, findCondition(healthy, v1alpha1.ClusterConditionControlPlaneHealthy).Reason)
	c := newConsumer(t, "credbroker", name)
	ns := optIn(t, spoke, "reader", c.username())
	require.NoError(t, spoke.Grant(ctx, "", framework.ServiceAccountSubject(ns, "reader"), []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"namespaces"}, Verbs: []string{"list"}},
	}))
	_, err = providerFileClient(t, b, c, healthy).CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
	require.NoError(t, err)

	// The spoke's /readyz fails: the cluster is let go, and the condition
	// says why.
	fault.failing.Store(true)
	var sick *v1alpha1.ClusterProfile
	framework.Eventually(t, 30*time.Second, 100*time.Millisecond, "ControlPlaneHealthy to turn False when the spoke's /readyz fails", func(c assert.TestingT) {
		sick = get(name)
		assert.False(c, engaged(sick), "ControlPlaneHealthy=True in %s", statusOf(sick))
	})
	cond := findCondition(sick, v1alpha1.ClusterConditionControlPlaneHealthy)
	assert.Equal(t, metav1.ConditionFalse, cond.Status)
	assert.Equal(t, publish.ReasonSpokeNotReady, cond.Reason)
	assert.Contains(t, cond.Message, "[-]etcd failed")
	assert.True(t, meta.IsStatusConditionTrue(sick.Status.Conditions, publish.ConditionType), "the agent is still connected")

	fault.failing.Store(false)
	framework.Eventually(t, 30*time.Second, 100*time.Millisecond, "ControlPlaneHealthy to turn True again when the spoke recovers", func(c assert.TestingT) {
		cp := get(name)
		assert.True(c, engaged(cp), "ControlPlaneHealthy=True in %s", statusOf(cp))
	})

	// The agent leaves: the cluster is let go once the grace is over.
	stopAgent()
	var gone *v1alpha1.ClusterProfile
	framework.Eventually(t, 30*time.Second, 100*time.Millisecond, "ControlPlaneHealthy to turn False when the agent leaves", func(c assert.TestingT) {
		gone = get(name)
		assert.False(c, engaged(gone), "ControlPlaneHealthy=True in %s", statusOf(gone))
	})
	assert.Equal(t, publish.ReasonNoAgentConnected, findCondition(gone, v1alpha1.ClusterConditionControlPlaneHealthy).Reason)

	// The cluster manager's condition was never the broker's to write.
	var other *v1alpha1.ClusterProfile
	framework.Eventually(t, 30*time.Second, 100*time.Millisecond, "the broker's condition on the managed ClusterProfile", func(c assert.TestingT) {
		other = get(managed)
		assert.True(c, meta.IsStatusConditionTrue(other.Status.Conditions, publish.ConditionType), "%s=True in %s", publish.ConditionType, statusOf(other))
	})
	cond = findCondition(other, v1alpha1.ClusterConditionControlPlaneHealthy)
	require.NotNil(t, cond)
	assert.Equal(t, "Maintenance", cond.Reason)
	assert.Equal(t, "written by the cluster manager", cond.Message)
}

// startHealthReportingAgent starts an agent for the ClusterProfile
// fleet/name that advertises spoke, reaches spoke through fault when it is
// not nil, and probes its /readyz every 200ms, reporting it not ready
// after two failures. The returned stop, which the test's end also calls,
// stops it once.
func startHealthReportingAgent(t *testing.T, spoke *framework.Cluster, name string, fault *readyzFault, publisher *broker.Broker) func() {
	t.Helper()
	stop, err := deployment.StartAgentWith(context.Background(), spoke, framework.AgentOptions{
		ID: framework.AgentID(name), Cluster: framework.FleetNamespace + "/" + name,
		Tune: func(c *agent.Config) {
			c.BrokerAddresses = append(c.BrokerAddresses, publisher.AgentAddr())
			c.AdvertiseServer, c.AdvertiseCAData = spoke.Server, spoke.CAData
			c.SpokeHealthInterval, c.SpokeHealthFailureThreshold = 200*time.Millisecond, 2
			if fault != nil {
				c.Spoke = fault.config(c.Spoke)
			}
		},
	})
	require.NoError(t, err)
	once := sync.OnceFunc(stop)
	t.Cleanup(once)
	return once
}
