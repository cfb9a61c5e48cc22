package e2e

import (
	"context"
	"encoding/json"
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	coordinationv1 "k8s.io/api/coordination/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"
	"sigs.k8s.io/cluster-inventory-api/pkg/access"

	"github.com/credbroker/credbroker/pkg/broker"
	"github.com/credbroker/credbroker/pkg/identity"
	"github.com/credbroker/credbroker/pkg/plugin"
	"github.com/credbroker/credbroker/pkg/publish"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// conflictsMetric counts the ClusterProfiles whose agents disagree on the
// server they advertise, or with the published one.
const conflictsMetric = "credbroker_advertised_server_conflicts"

// decoyServer is a TLS listener that an attacker advertises as a spoke's
// API server. It answers every request 403 and counts those that carried an
// Authorization header: a bearer token sent there is a stolen token.
type decoyServer struct {
	*httptest.Server
	caPEM    []byte
	requests atomic.Int32
	bearers  atomic.Int32
}

func startDecoy(t *testing.T) *decoyServer {
	t.Helper()
	d := &decoyServer{}
	d.Server = httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		d.requests.Add(1)
		if r.Header.Get("Authorization") != "" {
			d.bearers.Add(1)
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusForbidden)
		_, _ = w.Write([]byte(`{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Forbidden","code":403}`))
	}))
	t.Cleanup(d.Close)
	d.caPEM = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: d.Certificate().Raw})
	return d
}

// connectAdvertiser opens an AgentTunnel stream to addr with an SVID for
// the agent of fleet/<profile>, issued by the deployment's CA, and sends a
// hello that advertises server and caPEM: a process that holds the agent's
// SVID and nothing of the spoke. It reads and drops whatever the broker
// sends. The stream ends with the returned func, or with the test.
func connectAdvertiser(t *testing.T, addr, profile, server string, caPEM []byte) func() {
	t.Helper()
	return connectWithHello(t, addr, profile, &pb.Hello{AgentVersion: "advertiser", Server: server, CertificateAuthorityData: caPEM})
}

// stolenAgentCredentials are the client credentials of a process that holds
// an SVID for the agent of fleet/<profile>, issued by the deployment's CA.
func stolenAgentCredentials(t *testing.T, profile string) credentials.TransportCredentials {
	t.Helper()
	certPEM, keyPEM, err := deployment.CA.IssueSVID(framework.AgentID(profile), time.Hour)
	require.NoError(t, err)
	svid, err := x509svid.Parse(certPEM, keyPEM)
	require.NoError(t, err)
	bundle, err := x509bundle.Parse(deployment.CA.TrustDomain(), deployment.CA.BundlePEM())
	require.NoError(t, err)
	return identity.ClientCredentials(svid, bundle, spiffeid.RequireFromPath(deployment.CA.TrustDomain(), "/broker"))
}

// connectWithHello is connectAdvertiser with a hello of the caller's.
func connectWithHello(t *testing.T, addr, profile string, hello *pb.Hello) func() {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(stolenAgentCredentials(t, profile)))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	stop := sync.OnceFunc(func() {
		cancel()
		wg.Wait()
		_ = conn.Close()
	})
	t.Cleanup(stop)
	stream, err := framework.AdmitFakeAgentHello(ctx, pb.NewAgentTunnelClient(conn), hello)
	require.NoError(t, err, "the broker did not admit the second agent")
	wg.Go(func() {
		for {
			if _, err := stream.Recv(); err != nil {
				return
			}
		}
	})
	return stop
}

// pluginConfig builds a spoke client from cp's published access provider
// with cluster-inventory-api's pkg/access and a provider file that names
// credbroker-plugin, which exchanges c's hub token at the first broker.
func pluginConfig(t *testing.T, c consumer, cp *v1alpha1.ClusterProfile) kubernetes.Interface {
	t.Helper()
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(c.token), 0o600))
	raw, err := json.Marshal(access.Config{Providers: []access.Provider{{
		Name: plugin.Name,
		ExecConfig: &clientcmdapi.ExecConfig{
			APIVersion: "client.authentication.k8s.io/v1", Command: pluginBin, ProvideClusterInfo: true,
			Args: []string{"--broker-address", deployment.Broker.ExchangeAddr(), "--ca-file", deployment.CAFile, "--token-file", tokenFile},
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

func conflicts(t *testing.T, b *broker.Broker) float64 {
	t.Helper()
	m, err := framework.ScrapeMetrics(context.Background(), b.MetricsAddr())
	require.NoError(t, err)
	return m.Sum(conflictsMetric)
}

// disagreement reports whether cp's CredentialBrokerConnected condition
// says that its agents disagree on the server.
func disagreement(cp *v1alpha1.ClusterProfile) bool {
	c := findCondition(cp, publish.ConditionType)
	return c != nil && c.Status == metav1.ConditionTrue && strings.Contains(c.Message, "disagree")
}

// publishedNothing waits for the publisher's first condition on the
// ClusterProfile that get returns, and checks that no server was
// published, and that the condition says the agents disagree: one of them
// advertises decoyURL.
func publishedNothing(t *testing.T, get func() *v1alpha1.ClusterProfile, decoyURL string) {
	t.Helper()
	var cp *v1alpha1.ClusterProfile
	framework.Eventually(t, 30*time.Second, 100*time.Millisecond, "the publisher to write the condition", func(c assert.TestingT) {
		cp = get()
		assert.NotNil(c, findCondition(cp, publish.ConditionType), "%s in %s", publish.ConditionType, statusOf(cp))
	})
	if e := findProvider(cp, plugin.Name); e != nil {
		t.Errorf("%s was published while the agents disagree (the decoy is %s)", e.Cluster.Server, decoyURL)
	}
	assert.True(t, disagreement(cp), "the condition does not say that the agents disagree")
}

// holdLease has someone other than a broker hold the Lease default/name,
// so that a publisher of that Lease does not publish until release.
func holdLease(t *testing.T, name string) (release func()) {
	t.Helper()
	leases := env.Hub.Client.CoordinationV1().Leases("default")
	now := metav1.NewMicroTime(time.Now())
	_, err := leases.Create(context.Background(), &coordinationv1.Lease{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: coordinationv1.LeaseSpec{
			HolderIdentity: ptr.To("someone-else"), LeaseDurationSeconds: ptr.To[int32](3600),
			AcquireTime: &now, RenewTime: &now,
		},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	return func() { require.NoError(t, leases.Delete(context.Background(), name, metav1.DeleteOptions{})) }
}

// Trust boundary: no agent picks where consumers send tokens. The honest
// agent of a ClusterProfile is connected and its server published; a
// second process that holds the same agent's SVID (and no spoke
// credentials) connects to the publishing replica and advertises a TLS
// listener of its own. The published server stays the spoke's, the
// disagreement shows in the condition and in the conflicts gauge, and a
// pkg/access consumer reaches the real spoke: the listener never sees an
// Authorization header. When the second agent goes, the conflict clears.
func TestSecondAgentCannotRepointPublishedServer(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	name := uniqueName(t, "advertise")
	profiles := env.Hub.Inventory.ApisV1alpha1().ClusterProfiles(framework.FleetNamespace)
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, nil)
	require.NoError(t, err)
	get := func() *v1alpha1.ClusterProfile {
		cp, err := profiles.Get(ctx, name, metav1.GetOptions{})
		require.NoError(t, err)
		return cp
	}

	b, _ := startPublisher(t, name, "", nil)
	startAdvertisingAgent(t, spoke, name, b)
	framework.Eventually(t, 30*time.Second, 100*time.Millisecond, "the honest agent's server to be published", func(c assert.TestingT) {
		cp := get()
		e := findProvider(cp, plugin.Name)
		assert.True(c, e != nil && e.Cluster.Server == spoke.Server, "%s provider of %s in %s", plugin.Name, spoke.Server, statusOf(cp))
	})
	require.False(t, disagreement(get()))
	assert.Zero(t, conflicts(t, b))

	decoy := startDecoy(t)
	stopDecoyAgent := connectAdvertiser(t, b.AgentAddr(), name, decoy.URL, decoy.caPEM)
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		assert.Equal(ct, 2, b.Connected(framework.FleetNamespace, name), "agent streams of %s", name)
	},
		10*time.Second, 20*time.Millisecond, "the publisher holds both streams")

	// The publisher has looked at both agents once it either says they
	// disagree or has published something else.
	var cp *v1alpha1.ClusterProfile
	framework.Eventually(t, 30*time.Second, 100*time.Millisecond, "the publisher to react to the second agent", func(c assert.TestingT) {
		cp = get()
		e := findProvider(cp, plugin.Name)
		assert.True(c, disagreement(cp) || (e != nil && e.Cluster.Server != spoke.Server),
			"a disagreement, or a server other than %s, in %s", spoke.Server, statusOf(cp))
	})
	entry := findProvider(cp, plugin.Name)
	require.NotNil(t, entry)
	assert.Equal(t, spoke.Server, entry.Cluster.Server, "the second agent re-pointed the published server")
	assert.Equal(t, string(spoke.CAData), string(entry.Cluster.CertificateAuthorityData), "the second agent replaced the published CA")
	assert.Equal(t, 1.0, conflicts(t, b), "the disagreement is counted")

	// A consumer that builds its client from the ClusterProfile alone.
	c := newConsumer(t, "credbroker", name)
	ns := optIn(t, spoke, "reader", c.username())
	require.NoError(t, spoke.Grant(ctx, "", framework.ServiceAccountSubject(ns, "reader"), []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"namespaces"}, Verbs: []string{"list"}},
	}))
	nsList, listErr := pluginConfig(t, c, cp).CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
	assert.Zero(t, decoy.bearers.Load(), "the second agent's listener received a bearer token")
	assert.Zero(t, decoy.requests.Load(), "the consumer was sent to the second agent's listener")
	require.NoError(t, listErr)
	assert.NotEmpty(t, nsList.Items, "the consumer reaches the real spoke")

	// The second agent goes: the conflict clears, the entry stays.
	stopDecoyAgent()
	framework.Eventually(t, 30*time.Second, 100*time.Millisecond, "the conflict to clear when the second agent goes", func(c assert.TestingT) {
		cp := get()
		if assert.False(c, disagreement(cp), "a disagreement in %s", statusOf(cp)) {
			assert.Zero(c, conflicts(t, b), "%s", conflictsMetric)
		}
	})
	assert.Equal(t, spoke.Server, findProvider(get(), plugin.Name).Cluster.Server)
}

// Nothing is published while the agents of a ClusterProfile disagree
// before anything was: the publisher, which starts leading only once both
// agents are connected to it, writes the condition without an entry; once
// the second agent goes, the honest agent's server is published.
func TestDisagreeingAgentsPublishNothing(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	name := uniqueName(t, "disagree")
	profiles := env.Hub.Inventory.ApisV1alpha1().ClusterProfiles(framework.FleetNamespace)
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, nil)
	require.NoError(t, err)
	get := func() *v1alpha1.ClusterProfile {
		cp, err := profiles.Get(ctx, name, metav1.GetOptions{})
		require.NoError(t, err)
		return cp
	}

	// Someone else holds the publisher's Lease until both agents are in.
	release := holdLease(t, name)
	b, _ := startPublisher(t, name, "", nil)
	startAdvertisingAgent(t, spoke, name, b)
	decoy := startDecoy(t)
	stopDecoyAgent := connectAdvertiser(t, b.AgentAddr(), name, decoy.URL, decoy.caPEM)
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		assert.Equal(ct, 2, b.Connected(framework.FleetNamespace, name), "agent streams of %s", name)
	},
		10*time.Second, 20*time.Millisecond, "the publisher holds both streams")
	require.Empty(t, get().Status.Conditions, "the publisher wrote before it held the Lease")
	release()

	publishedNothing(t, get, decoy.URL)
	assert.Equal(t, 1.0, conflicts(t, b), "the disagreement is counted")
	assert.Zero(t, decoy.requests.Load())

	stopDecoyAgent()
	framework.Eventually(t, 30*time.Second, 100*time.Millisecond, "the honest agent's server to be published once the agents agree", func(c assert.TestingT) {
		e := findProvider(get(), plugin.Name)
		cp := get()
		assert.True(c, e != nil && e.Cluster.Server == spoke.Server && !disagreement(cp),
			"%s provider of %s and no disagreement in %s", plugin.Name, spoke.Server, statusOf(cp))
	})
	assert.Equal(t, string(spoke.CAData), string(findProvider(get(), plugin.Name).Cluster.CertificateAuthorityData))
	assert.Zero(t, conflicts(t, b))
}
