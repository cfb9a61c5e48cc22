package e2e

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"
	ctrlclient "sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/credbroker/credbroker/pkg/agent"
	"github.com/credbroker/credbroker/pkg/apiproxy"
	"github.com/credbroker/credbroker/pkg/broker"
	"github.com/credbroker/credbroker/pkg/brokerclient"
	"github.com/credbroker/credbroker/pkg/client"
	"github.com/credbroker/credbroker/pkg/grants"
	"github.com/credbroker/credbroker/pkg/plugin"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// dataPathProfile creates a ClusterProfile of spoke whose access provider
// is the first replica's API proxy, and starts an agent for it that offers
// its API server through the data path; it returns the ClusterProfile's
// name and the proxy URL of it.
func dataPathProfile(t *testing.T, spoke *framework.Cluster, prefix string) (name, server string) {
	t.Helper()
	ctx := context.Background()
	name = uniqueName(t, prefix)
	access, err := deployment.DataPathAccess(spoke, "https://"+deployment.Broker.ProxyAddr(), framework.FleetNamespace, name)
	require.NoError(t, err)
	_, err = env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, access)
	require.NoError(t, err)
	stop, err := deployment.StartAgentWith(ctx, spoke, framework.AgentOptions{
		ID: framework.AgentID(name), Tune: func(c *agent.Config) { c.DataPath = true },
	})
	require.NoError(t, err)
	t.Cleanup(stop)
	return name, access.Server
}

// proxyClient is a client of server, the API proxy's URL of a
// ClusterProfile, that sends bearer.
func proxyClient(t *testing.T, server, bearer string) kubernetes.Interface {
	t.Helper()
	ca, err := os.ReadFile(deployment.CAFile)
	require.NoError(t, err)
	// Timeout bounds every request, watches included, of a proxy that
	// accepts a connection but never answers.
	c, err := kubernetes.NewForConfig(&rest.Config{Host: server, BearerToken: bearer, TLSClientConfig: rest.TLSClientConfig{CAData: ca}, Timeout: time.Minute})
	require.NoError(t, err)
	return c
}

// A consumer reaches a spoke through the broker's API proxy with the token
// the exchange gave it: a LIST, and a watch that receives an event, both
// carried by the agent's konnectivity stream (the proxy dials no address
// of the spoke; the agent connects the dial to its API server).
func TestDataPathCarriesRequestsAndWatches(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	name, server := dataPathProfile(t, spoke, "datapath")
	c := newConsumer(t, "credbroker", name)
	ns := optIn(t, spoke, "reader", c.username())
	require.NoError(t, spoke.Grant(ctx, ns, framework.ServiceAccountSubject(ns, "reader"), []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"configmaps"}, Verbs: []string{"list", "watch", "create"}},
	}))

	resp, err := exchange(t, c, &pb.ExchangeRequest{Cluster: clusterKeyRef(name), ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: "reader"}})
	require.NoError(t, err)
	assert.Equal(t, server, resp.GetServer(), "the exchange answers the proxy's URL of the ClusterProfile")
	client := proxyClient(t, server, resp.GetToken())

	var last error
	if !assert.Eventually(t, func() bool {
		_, last = client.CoreV1().ConfigMaps(ns).List(ctx, metav1.ListOptions{})
		return last == nil
	}, 10*time.Second, 50*time.Millisecond) {
		t.Fatalf("the proxy never carried a LIST: %v", last)
	}

	w, err := client.CoreV1().ConfigMaps(ns).Watch(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	defer w.Stop()
	_, err = spoke.Client.CoreV1().ConfigMaps(ns).Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "seen"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	select {
	case ev := <-w.ResultChan():
		assert.Equal(t, watch.Added, ev.Type)
		cm, ok := ev.Object.(*corev1.ConfigMap)
		require.True(t, ok, "%T", ev.Object)
		assert.Equal(t, "seen", cm.Name)
	case <-time.After(20 * time.Second):
		t.Fatal("the watch through the proxy received no event")
	}
}

// The proxy forwards only live tokens that credbroker minted for the
// ClusterProfile of the path: every other request gets 401 from the
// broker, and a revoked token within a second of its revoke.
func TestDataPathRefusesWhatItDidNotMint(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	name, server := dataPathProfile(t, spoke, "datapath-refusals")
	other, otherServer := dataPathProfile(t, spoke, "datapath-other")
	c := newConsumer(t, "credbroker", name, other)
	ns := optIn(t, spoke, "reader", c.username())
	require.NoError(t, spoke.Grant(ctx, "", framework.ServiceAccountSubject(ns, "reader"), []rbacv1.PolicyRule{listNS}))
	req := func(cluster string) *pb.ExchangeRequest {
		return &pb.ExchangeRequest{Cluster: clusterKeyRef(cluster), ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: "reader"}}
	}
	resp, err := exchange(t, c, req(name))
	require.NoError(t, err)
	// Every request carries a label selector of its own, which the spoke's
	// audit log records in the request URI of whatever reaches it.
	list := func(server, bearer, marker string) error {
		_, err := proxyClient(t, server, bearer).CoreV1().Namespaces().List(ctx, metav1.ListOptions{LabelSelector: "credbroker-e2e-probe=" + marker})
		return err
	}
	seen := func(marker string) bool {
		events, err := spoke.AuditEvents(func(ev framework.AuditEvent) bool {
			return strings.Contains(ev.RequestURI, "credbroker-e2e-probe%3D"+marker)
		})
		require.NoError(t, err)
		return len(events) > 0
	}
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		assert.NoError(ct, list(server, resp.GetToken(), "served"), "a LIST through the proxy")
	}, 10*time.Second, 50*time.Millisecond, "the proxy to serve a LIST")
	framework.Eventually(t, 10*time.Second, 50*time.Millisecond, "the forwarded request in the spoke's audit log", func(ct assert.TestingT) {
		assert.True(ct, seen("served"), "no request with the probe selector served in %s", spoke.AuditLog)
	})

	notMinted, err := spoke.Token(ctx, ns, "reader", nil, 0)
	require.NoError(t, err)
	// The minted token's claims and credential id with another signature.
	head, _, _ := strings.Cut(resp.GetToken(), ".")
	claims := strings.Split(resp.GetToken(), ".")[1]
	forged := head + "." + claims + "." + strings.Repeat("A", 86)
	refused := []struct{ name, server, bearer string }{
		{"another ClusterProfile's path", otherServer, resp.GetToken()},
		{"a hub token", server, c.token},
		{"a spoke token credbroker did not mint", server, notMinted},
		{"a minted token's credential id with another signature", server, forged},
		{"no token", server, ""},
	}
	for i, tt := range refused {
		t.Run(tt.name, func(t *testing.T) {
			err := list(tt.server, tt.bearer, fmt.Sprintf("refused-%d", i))
			require.Error(t, err)
			assert.True(t, apierrors.IsUnauthorized(err), "%v", err)
			assert.Contains(t, err.Error(), "credbroker:", "the spoke answered, not the broker")
		})
	}
	// A request is audited when it completes; the forwarded one was seen
	// above, and these were sent before the check.
	require.NoError(t, list(server, resp.GetToken(), "last"))
	framework.Eventually(t, 10*time.Second, 50*time.Millisecond, "the last forwarded request in the spoke's audit log", func(ct assert.TestingT) {
		assert.True(ct, seen("last"), "no request with the probe selector last in %s", spoke.AuditLog)
	})
	for i, tt := range refused {
		assert.False(t, seen(fmt.Sprintf("refused-%d", i)), "%s was forwarded to the spoke", tt.name)
	}

	t.Run("a revoked token", func(t *testing.T) {
		reg := deployment.Broker.Grants()
		live := reg.Select(grants.Selector{CredentialID: resp.GetCredentialId()})
		require.Len(t, live, 1)
		revoked := time.Now()
		go reg.Revoke(ctx, live, "the test revoked it")
		var last error
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			last = list(server, resp.GetToken(), "after-revoke")
			assert.True(ct, apierrors.IsUnauthorized(last), "a LIST with the revoked token: want Unauthorized, got %v", last)
		}, 5*time.Second, 10*time.Millisecond, "the proxy to refuse the revoked token")
		took := time.Since(revoked)
		t.Logf("refused %v after the revoke: %v", took.Round(time.Millisecond), last)
		assert.Less(t, took, time.Second, "the proxy forwarded a revoked token for %v", took)
	})
}

func clusterKey(name string) types.NamespacedName {
	return types.NamespacedName{Namespace: framework.FleetNamespace, Name: name}
}

func clusterKeyRef(name string) *pb.ObjectReference {
	return &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: name}
}

// A stolen agent identity cannot take the proxy's connections, and the
// tokens in them, to a server of its own. Beside the honest agent, a
// process that holds the agent's SVID and nothing of the spoke offers its
// own listener and CA in its hello and carries most of the replica's dials
// (four data path streams to the agent's one), connecting them to that
// listener. The proxy verifies the spoke with what the ClusterProfile's
// status records, never with an agent's offer: the listener completes no
// handshake, receives no token, and the consumer still reaches the spoke.
func TestStolenAgentIdentityCannotRedirectTheDataPath(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	name, server := dataPathProfile(t, spoke, "datapath-stolen")
	c := newConsumer(t, "credbroker", name)
	ns := optIn(t, spoke, "reader", c.username())
	require.NoError(t, spoke.Grant(ctx, "", framework.ServiceAccountSubject(ns, "reader"), []rbacv1.PolicyRule{listNS}))
	resp, err := exchange(t, c, &pb.ExchangeRequest{Cluster: clusterKeyRef(name), ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: "reader"}})
	require.NoError(t, err)

	decoy := startDecoy(t)
	decoyURL, err := url.Parse(decoy.URL)
	require.NoError(t, err)
	connectWithHello(t, deployment.Broker.AgentAddr(), name, &pb.Hello{AgentVersion: "thief", DataPath: &pb.DataPath{
		ServerName: decoyURL.Hostname(), CertificateAuthorityData: decoy.caPEM,
	}})
	rctx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	for range 4 {
		thief, err := apiproxy.NewBackend(apiproxy.BackendConfig{
			Credentials: stolenAgentCredentials(t, name), APIServer: decoyURL.Host, Log: logr.Discard(),
		})
		require.NoError(t, err)
		go thief.Serve(rctx, deployment.Broker.AgentAddr())
	}
	key := clusterKey(name)
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		assert.Equal(ct, 5, deployment.Broker.DataPathStreams(key.Namespace, key.Name), "data path streams of %s", key)
	}, 10*time.Second, 20*time.Millisecond, "the thief's streams never joined")

	// Each request on a new connection, so that each dials anew.
	var served, failed int
	for range 20 {
		ca, err := os.ReadFile(deployment.CAFile)
		require.NoError(t, err)
		client, err := kubernetes.NewForConfig(&rest.Config{Host: server, BearerToken: resp.GetToken(),
			TLSClientConfig: rest.TLSClientConfig{CAData: ca}, DisableCompression: true})
		require.NoError(t, err)
		if _, err := client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{}); err == nil {
			served++
		} else {
			failed++
		}
	}
	t.Logf("20 requests: %d served by the spoke, %d failed on the thief's streams; the thief's listener got %d requests, %d with a token",
		served, failed, decoy.requests.Load(), decoy.bearers.Load())
	assert.Zero(t, decoy.bearers.Load(), "the thief's listener received a token")
	assert.Zero(t, decoy.requests.Load(), "the proxy sent a request to the thief's listener")
	assert.Positive(t, served, "the consumer never reached the spoke")
}

// Trust boundary: a stream that advertises a server of its own does not win
// the first publication while the ClusterProfile's honest agents offer the
// data path and advertise none (security.md 19.5). A process holding the
// agent's SVID connects beside the honest data-path agent before the
// publisher first looks: nothing is published while they disagree, and
// once it goes, the API proxy's URL is.
func TestStolenAgentIdentityCannotPublishOverTheDataPath(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	name := uniqueName(t, "datapath-first")
	key := types.NamespacedName{Namespace: framework.FleetNamespace, Name: name}
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, nil)
	require.NoError(t, err)
	get := func() *v1alpha1.ClusterProfile {
		cp, err := env.Hub.Inventory.ApisV1alpha1().ClusterProfiles(framework.FleetNamespace).Get(ctx, name, metav1.GetOptions{})
		require.NoError(t, err)
		return cp
	}

	release := holdLease(t, name)
	const proxyURL = "https://credbroker-proxy.example:8445"
	b, _ := startPublisher(t, name, "", func(c *broker.Config) {
		c.ProxyAddress, c.ProxyURL, c.ProxyCAData = "127.0.0.1:0", proxyURL, deployment.CA.BundlePEM()
	})
	stop, err := deployment.StartAgentWith(ctx, spoke, framework.AgentOptions{
		ID: framework.AgentID(name), Cluster: key.String(),
		Tune: func(c *agent.Config) { c.DataPath, c.BrokerAddresses = true, append(c.BrokerAddresses, b.AgentAddr()) },
	})
	require.NoError(t, err)
	t.Cleanup(stop)
	decoy := startDecoy(t)
	stopThief := connectAdvertiser(t, b.AgentAddr(), name, decoy.URL, decoy.caPEM)
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		assert.Equal(ct, 2, b.Connected(framework.FleetNamespace, name), "agent streams of %s", name)
	},
		10*time.Second, 20*time.Millisecond, "the publisher holds both streams")
	release()

	publishedNothing(t, get, decoy.URL)

	stopThief()
	framework.Eventually(t, 30*time.Second, 100*time.Millisecond, "the API proxy's URL to be published once the agents agree", func(ct assert.TestingT) {
		cp := get()
		e := findProvider(cp, plugin.Name)
		assert.True(ct, e != nil && e.Cluster.Server == apiproxy.URL(proxyURL, key), "%s provider of %s in %s", plugin.Name, apiproxy.URL(proxyURL, key), statusOf(cp))
	})
	assert.Zero(t, decoy.requests.Load())
}

// failover forwards each connection to the first of targets that accepts
// it, as a Service in front of the replicas would once a replica is gone.
func failover(t *testing.T, targets ...string) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = lis.Close() })
	go relay(lis, func() (net.Conn, error) {
		for _, target := range targets {
			if out, err := net.DialTimeout("tcp", target, time.Second); err == nil {
				return out, nil
			}
		}
		return nil, errors.New("no target accepts")
	})
	return lis.Addr().String()
}

// The replica that carries a watch goes; the watch ends, and the
// consumer's next request succeeds through the other replica, which knows
// the token from the agent's grant report and has its own data path
// stream from the agent.
func TestDataPathSurvivesTheReplicaThatCarriesAWatch(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	name, _ := dataPathProfile(t, spoke, "datapath-ha")
	c := newConsumer(t, "credbroker", name)
	ns := optIn(t, spoke, "reader", c.username())
	require.NoError(t, spoke.Grant(ctx, ns, framework.ServiceAccountSubject(ns, "reader"), []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"configmaps"}, Verbs: []string{"list", "watch"}},
	}))
	resp, err := exchange(t, c, &pb.ExchangeRequest{Cluster: clusterKeyRef(name), ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: "reader"}})
	require.NoError(t, err)
	key := clusterKey(name)
	for i, b := range deployment.Brokers {
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			assert.Equal(ct, 1, b.DataPathStreams(key.Namespace, key.Name), "replica %d's data path streams of %s", i, key)
		}, 10*time.Second, 20*time.Millisecond, "replica %d has no data path stream of the agent", i)
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			_, ok := b.Grants().Live(resp.GetCredentialId())
			assert.True(ct, ok, "replica %d knows grant %s live", i, resp.GetCredentialId())
		}, 10*time.Second, 20*time.Millisecond, "replica %d does not know the token", i)
	}
	front := failover(t, deployment.Brokers[0].ProxyAddr(), deployment.Brokers[1].ProxyAddr())
	client := proxyClient(t, apiproxy.URL("https://"+front, key), resp.GetToken())

	w, err := client.CoreV1().ConfigMaps(ns).Watch(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	defer w.Stop()
	servedBy := func(i int) float64 {
		m, err := framework.ScrapeMetrics(ctx, deployment.Brokers[i].MetricsAddr())
		require.NoError(t, err)
		return m.Sum("credbroker_apiproxy_requests_total", `cluster="`+key.String()+`"`, `code="200"`)
	}
	before := servedBy(1)

	restarted, restartDone := make(chan error, 1), make(chan struct{})
	go func() {
		defer close(restartDone)
		_, err := deployment.RestartBroker(0)
		restarted <- err
	}()
	// The next test, whichever it is, finds the suite's agents on both
	// replicas, as drain_test.go leaves them: they reconnect to the
	// restarted one on their own, a moment after it runs.
	t.Cleanup(func() {
		select {
		case <-restartDone:
		case <-time.After(time.Minute):
			t.Error("broker-0 did not restart within a minute")
			return
		}
		for _, s := range env.Spokes {
			assert.EventuallyWithT(t, func(ct *assert.CollectT) {
				assert.GreaterOrEqual(ct, deployment.Brokers[0].Connected(framework.FleetNamespace, s.Name), 1, "agent streams of %s", s.Name)
			},
				30*time.Second, 20*time.Millisecond, "the suite's agent of %s did not come back to the restarted broker-0", s.Name)
		}
	})
	ended := time.After(30 * time.Second)
	for open := true; open; {
		select {
		case _, open = <-w.ResultChan():
		case <-ended:
			t.Fatal("the watch outlived its replica")
		}
	}
	listCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	_, err = client.CoreV1().ConfigMaps(ns).List(listCtx, metav1.ListOptions{})
	require.NoError(t, err, "the next request after the replica went")
	select {
	case err := <-restarted:
		require.NoError(t, err)
	case <-time.After(time.Minute):
		t.Fatal("the replica did not restart within a minute")
	}
	assert.Greater(t, servedBy(1), before, "the other replica did not serve the next request")
}

// pkg/client reaches a data path spoke with nothing new: the exchange
// answers the proxy's URL, and a controller-runtime client lists through
// it with the tokens pkg/client gets.
func TestGoClientThroughTheDataPath(t *testing.T) {
	spoke := env.Spokes[1]
	name, server := dataPathProfile(t, spoke, "datapath-client")
	c := newConsumer(t, "credbroker", name)
	ns := optIn(t, spoke, "controller", c.username())
	require.NoError(t, spoke.Grant(t.Context(), ns, framework.ServiceAccountSubject(ns, "controller"), []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"serviceaccounts"}, Verbs: []string{"list"}},
	}))
	tokenFile := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(c.token), 0o600))
	roots, err := brokerclient.LoadCAFile(deployment.CAFile)
	require.NoError(t, err)
	tokens, err := client.NewFileTokenSource(tokenFile, 0, nil)
	require.NoError(t, err)
	gc, err := client.New(client.Config{
		Address: deployment.Broker.ExchangeAddr(), TLS: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}, TokenSource: tokens,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = gc.Close() })
	cfg, err := gc.RESTConfigFor(t.Context(), framework.FleetNamespace, name)
	require.NoError(t, err)
	assert.Equal(t, server, cfg.Host)
	cl, err := ctrlclient.New(cfg, ctrlclient.Options{})
	require.NoError(t, err)
	var sas corev1.ServiceAccountList
	require.NoError(t, cl.List(t.Context(), &sas, ctrlclient.InNamespace(ns)))
	var names []string
	for _, sa := range sas.Items {
		names = append(names, sa.Name)
	}
	assert.Contains(t, names, "controller")
}
