package e2e

import (
	"context"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// scrapeMetrics reads the /metrics page at addr.
func scrapeMetrics(t *testing.T, addr string) *framework.Metrics {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	m, err := framework.ScrapeMetrics(ctx, addr)
	require.NoError(t, err)
	return m
}

// monitoredNames reads deploy/monitoring/metric-names.txt, which
// test/monitoring keeps equal to the metrics the alerts and the dashboard
// name.
func monitoredNames(t *testing.T) []string {
	t.Helper()
	raw, err := os.ReadFile("../../deploy/monitoring/metric-names.txt")
	require.NoError(t, err)
	var names []string
	for line := range strings.Lines(string(raw)) {
		if line = strings.TrimSpace(line); line != "" && !strings.HasPrefix(line, "#") {
			names = append(names, line)
		}
	}
	require.NotEmpty(t, names)
	return names
}

// Every metric that deploy/monitoring's alerts and dashboard name is
// exposed by a running broker or agent once an exchange has gone through.
func TestMonitoredMetricsExist(t *testing.T) {
	spoke := env.Spokes[0]
	c := newConsumer(t, "credbroker", spoke.Name)
	ns := optIn(t, spoke, "metrics", c.username())
	_, err := exchange(t, c, &pb.ExchangeRequest{Cluster: clusterRef(spoke), ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: "metrics"}})
	require.NoError(t, err)

	brokerPage := scrapeMetrics(t, deployment.Broker.MetricsAddr())
	agents := deployment.Agents(spoke.Name)
	require.NotEmpty(t, agents)
	agentPage := scrapeMetrics(t, agents[0].MetricsAddr())

	for _, name := range monitoredNames(t) {
		assert.True(t, brokerPage.Has(name) || agentPage.Has(name), "neither the broker nor the agent exposes %s", name)
	}

	// The values are the deployment's: each replica sees both spokes'
	// agents, and its SVID is valid for about an hour.
	assert.Equal(t, float64(len(env.Spokes)), brokerPage.Sum("credbroker_connected_clusters"))
	assert.GreaterOrEqual(t, brokerPage.Sum("credbroker_cluster_profiles"), float64(len(env.Spokes)))
	assert.Equal(t, 1.0, brokerPage.Sum("credbroker_build_info"))
	for _, p := range []struct {
		page *framework.Metrics
		name string
	}{{brokerPage, "credbroker_svid_expiry_timestamp_seconds"}, {agentPage, "credbroker_agent_svid_expiry_timestamp_seconds"}} {
		assert.InDelta(t, float64(time.Now().Unix()), p.page.Sum(p.name), float64(2*time.Hour/time.Second), p.name)
		assert.Greater(t, p.page.Sum(p.name), float64(time.Now().Unix()), p.name)
	}
	assert.Contains(t, agentPage.Text, `credbroker_agent_token_requests_total{code="201"}`)
	assert.Equal(t, float64(len(deployment.Brokers)), agentPage.Sum("credbroker_agent_broker_streams"), "one serving stream per broker replica")
	assert.Equal(t, agentPage.Sum("credbroker_agent_broker_target_addresses"), agentPage.Sum("credbroker_agent_broker_target_streams"))
	assert.NotContains(t, brokerPage.Text, c.token, "a token in the metrics")
}

// Two broker replicas in one process keep their own counters: an exchange
// on replica 0 moves replica 0's, not replica 1's.
func TestMetricsPerReplica(t *testing.T) {
	require.GreaterOrEqual(t, len(deployment.Brokers), 2)
	spoke := env.Spokes[0]
	c := newConsumer(t, "credbroker", spoke.Name)
	ns := optIn(t, spoke, "metrics", c.username())

	const counter = "credbroker_exchanges_total"
	before0 := scrapeMetrics(t, deployment.Brokers[0].MetricsAddr()).Sum(counter)
	before1 := scrapeMetrics(t, deployment.Brokers[1].MetricsAddr()).Sum(counter)
	_, err := exchangeVia(t, exchangeClientAt(t, deployment.Brokers[0].ExchangeAddr()), c,
		&pb.ExchangeRequest{Cluster: clusterRef(spoke), ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: "metrics"}})
	require.NoError(t, err)

	assert.Equal(t, before0+1, scrapeMetrics(t, deployment.Brokers[0].MetricsAddr()).Sum(counter), "replica 0 counts its exchange")
	assert.Equal(t, before1, scrapeMetrics(t, deployment.Brokers[1].MetricsAddr()).Sum(counter), "replica 1 counts replica 0's exchange")
}

// Without --profiling, the metrics port serves no profile: goroutine stacks
// and heap profiles are not for whoever reaches /metrics.
func TestNoProfilingByDefault(t *testing.T) {
	for _, path := range []string{"/debug/pprof/", "/debug/pprof/goroutine", "/debug/pprof/heap"} {
		resp, err := http.Get("http://" + deployment.Broker.MetricsAddr() + path)
		require.NoError(t, err)
		_ = resp.Body.Close()
		assert.Equal(t, http.StatusNotFound, resp.StatusCode, path)
	}
}
