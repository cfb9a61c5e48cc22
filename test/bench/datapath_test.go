package bench

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	"github.com/credbroker/credbroker/test/framework"
)

const (
	// dataPathProfile is the ClusterProfile of the spoke that scenario h
	// reaches through the broker's API proxy.
	dataPathProfile = "bench-datapath"
	// bigObjects ConfigMaps of bigObjectBytes each make the LIST of
	// scenario h about 10 MiB.
	bigObjects, bigObjectBytes = 10, 1_000_000
	// idleWatches is how many idle connections scenario h holds open
	// through the proxy to weigh one.
	idleWatches = 100
)

// dataPath is scenario h: the same requests of one spoke token straight to
// the spoke API server and through the broker's API proxy (broker and
// agent binaries, the agent's konnectivity stream): a 10 MiB LIST, a small
// GET, and the memory of idle connections held open through the proxy.
func (b *bench) dataPath(t *testing.T) {
	ctx := t.Context()
	proxyAddr, err := framework.FreeAddr()
	require.NoError(t, err)
	bp := startBroker(t, "audit-datapath.log", "--proxy-address="+proxyAddr, "--proxy-url=https://"+proxyAddr, "--proxy-ca-file="+deployment.CAFile)
	waitReady(t, bp)
	client, conn, err := deployment.ExchangeClient(bp.exchange)
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })

	// The ClusterProfile names the proxy as its server, and the spoke API
	// server the proxy verifies, as the publisher pins it.
	access, err := deployment.DataPathAccess(spoke, "https://"+proxyAddr, framework.FleetNamespace, dataPathProfile)
	require.NoError(t, err)
	_, err = env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, dataPathProfile, access)
	require.NoError(t, err)

	// The agent binary as a spoke admin runs it for a private API server:
	// no --advertise-server, so its data path is on.
	agentMetrics, err := framework.FreeAddr()
	require.NoError(t, err)
	agentProc, err := deployment.StartAgentProcess(ctx, spoke, framework.AgentProcessOptions{
		Bin: agentBin, BrokerAddresses: []string{bp.agent}, ClusterProfile: dataPathProfile,
		Args: []string{"--metrics-address=" + agentMetrics},
	})
	require.NoError(t, err)
	b.root.Cleanup(agentProc.Stop)
	b.waitServesVia(t, client, bp, dataPathProfile, agentProc)

	// The target may read ConfigMaps of its namespace; the big ones make
	// the LIST, "small" the GET.
	require.NoError(t, spoke.Grant(ctx, targetNS, framework.ServiceAccountSubject(targetNS, targetSA), []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"configmaps"}, Verbs: []string{"get", "list", "watch"}},
	}))
	for i := range bigObjects {
		_, err := spoke.Client.CoreV1().ConfigMaps(targetNS).Create(ctx, &corev1.ConfigMap{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("big-%d", i), Labels: map[string]string{"bench": "big"}},
			Data:       map[string]string{"data": strings.Repeat("x", bigObjectBytes)},
		}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	_, err = spoke.Client.CoreV1().ConfigMaps(targetNS).Create(ctx, &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: "small"}, Data: map[string]string{"k": "v"},
	}, metav1.CreateOptions{})
	require.NoError(t, err)

	resp, err := client.Exchange(bearer(ctx, b.consumers[0].Token), exchangeRequest(dataPathProfile))
	require.NoError(t, err)
	require.Equal(t, access.Server, resp.GetServer(), "the exchange answers the proxy's URL")
	direct := &rest.Config{Host: spoke.Server, BearerToken: resp.GetToken(), TLSClientConfig: rest.TLSClientConfig{CAData: spoke.CAData}}
	proxied := &rest.Config{Host: resp.GetServer(), BearerToken: resp.GetToken(), TLSClientConfig: rest.TLSClientConfig{CAData: resp.GetCertificateAuthorityData()}}
	directClient, proxyClient := rawClient(t, direct), rawClient(t, proxied)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		_, err := getSmall(ctx, proxyClient)
		assert.NoError(c, err, "a GET through the proxy")
	}, 30*time.Second, 100*time.Millisecond, "the proxy never carried a GET")

	b.dataPathList(t, directClient, proxyClient)
	b.dataPathGet(t, directClient, proxyClient)
	b.dataPathIdle(t, bp, agentMetrics, proxied)
	addNote("h: one spoke token (the target's, minted through the data path's own broker process and agent process), used straight on the spoke "+
		"API server and through `--proxy-address` of a second broker process; the agent runs without --advertise-server, so its konnectivity "+
		"agent carries the proxy's dials to the spoke. The LIST is %d ConfigMaps of %d bytes, JSON, alternately direct and proxied; the GET is "+
		"one small ConfigMap, alternately; each client keeps its connection. Idle connections: %d watches that see no event, each on a TLS "+
		"connection of its own to the proxy; memory is the broker's heap in use and both processes' RSS after a forced GC (the agent's RSS "+
		"without one), before and after, divided by the count.", bigObjects, bigObjectBytes, idleWatches)
}

// rawClient is a REST client of cfg on a transport of its own, unthrottled.
func rawClient(t *testing.T, cfg *rest.Config) rest.Interface {
	return unthrottledClient(t, cfg).CoreV1().RESTClient()
}

func getSmall(ctx context.Context, c rest.Interface) ([]byte, error) {
	return c.Get().AbsPath("/api/v1/namespaces", targetNS, "configmaps", "small").DoRaw(ctx)
}

// dataPathList times the 10 MiB LIST, alternately direct and proxied.
func (b *bench) dataPathList(t *testing.T, direct, proxied rest.Interface) {
	ctx := t.Context()
	const rounds = 10
	list := func(c rest.Interface) (int, time.Duration) {
		start := time.Now()
		body, err := c.Get().AbsPath("/api/v1/namespaces", targetNS, "configmaps").Param("labelSelector", "bench=big").DoRaw(ctx)
		took := time.Since(start)
		require.NoError(t, err)
		return len(body), took
	}
	list(direct)
	list(proxied)
	var bytes [2]int
	var took [2]time.Duration
	for range rounds {
		for i, c := range []rest.Interface{direct, proxied} {
			n, d := list(c)
			bytes[i] += n
			took[i] += d
		}
	}
	mibps := func(i int) float64 { return float64(bytes[i]) / (1 << 20) / took[i].Seconds() }
	ratio := mibps(1) / mibps(0)
	addRow(row{"h. data path, 10 MiB LIST", "throughput", fmt.Sprintf("%.0f MiB/s", mibps(1)), fmt.Sprintf("direct %.0f MiB/s", mibps(0)),
		fmt.Sprintf("%.2f", ratio), "≥ 0.50 of direct", verdict(ratio >= 0.5)})
	t.Logf("LIST of %d bytes: proxied %.1f MiB/s, direct %.1f MiB/s", bytes[1]/rounds, mibps(1), mibps(0))
}

// dataPathGet times the small GET, alternately direct and proxied.
func (b *bench) dataPathGet(t *testing.T, direct, proxied rest.Interface) {
	ctx := t.Context()
	const n = 300
	calls, err := sequential(n, func(int) ([]time.Duration, error) {
		var parts []time.Duration
		for _, c := range []rest.Interface{direct, proxied} {
			start := time.Now()
			if _, err := getSmall(ctx, c); err != nil {
				return nil, err
			}
			parts = append(parts, time.Since(start))
		}
		return parts, nil
	})
	require.NoError(t, err)
	d, p := column(calls, 0), column(calls, 1)
	added := quantile(p, 0.5) - quantile(d, 0.5)
	addRow(row{"h. data path, small GET", "latency p50 / p99", fmt.Sprintf("%s / %s", ms(quantile(p, 0.5)), ms(quantile(p, 0.99))),
		fmt.Sprintf("direct %s / %s", ms(quantile(d, 0.5)), ms(quantile(d, 0.99))), "+" + ms(added) + " p50", "≤ +2 ms p50", verdict(added <= 2*time.Millisecond)})
}

// dataPathIdle weighs an idle connection through the proxy: watches that
// see no event, each on a connection of its own.
func (b *bench) dataPathIdle(t *testing.T, bp brokerProc, agentMetrics string, proxied *rest.Config) {
	ctx := t.Context()
	agentRSS := func() float64 {
		v, err := brokerMetric(ctx, agentMetrics, "process_resident_memory_bytes")
		require.NoError(t, err)
		return v
	}
	before, agentBefore := sample(t, bp, "datapath-heap-before.pb.gz"), agentRSS()
	watchCtx, stop := context.WithCancel(ctx)
	defer stop()
	for range idleWatches {
		_, err := rawClient(t, proxied).Get().AbsPath("/api/v1/namespaces", targetNS, "configmaps").
			Param("watch", "true").Param("labelSelector", "bench=none").Watch(watchCtx)
		require.NoError(t, err)
	}
	time.Sleep(2 * time.Second)
	after, agentAfter := sample(t, bp, "datapath-heap-after.pb.gz"), agentRSS()
	per := func(a, b float64) string { return fmt.Sprintf("%.1f KiB", (a-b)/idleWatches/1024) }
	addRow(row{"h. data path, idle connection", "memory each (broker heap / broker RSS / agent RSS)",
		fmt.Sprintf("%s / %s / %s", per(after.heap, before.heap), per(after.rss, before.rss), per(agentAfter, agentBefore)),
		fmt.Sprintf("%d watches", idleWatches), "", "", ""})
}
