package faults

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/credbroker/credbroker/pkg/publish"
	"github.com/credbroker/credbroker/test/framework"
)

// A starting replica is not ready, so the Service sends it no consumer,
// until the agents of the clusters it would serve have found it: every
// ClusterProfile that the publishing replica reports connected has a
// stream to it, or --agent-reconnect-window has passed. Before: the broker
// was ready once its informer had synced and its keys were loaded, and
// the first consumers of a cluster whose agent had not found it yet got
// Unavailable.
func TestReadinessWaitsForTheAgents(t *testing.T) {
	ctx := t.Context()
	name := unique("arrival")
	cp, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, deployment.ProfileAccess(spoke1, framework.FleetNamespace, name))
	require.NoError(t, err)
	// Its CredentialBrokerConnected condition outlives the test, and would
	// make every broker that starts later wait for its agent.
	t.Cleanup(func() { deleteClusterProfile(t, name) })
	// The publishing replica says an agent of it is connected.
	cp.Status.Conditions = append(cp.Status.Conditions, metav1.Condition{
		Type: publish.ConditionType, Status: metav1.ConditionTrue, Reason: publish.ReasonAgentConnected, LastTransitionTime: metav1.Now(),
	})
	_, err = env.Hub.Inventory.ApisV1alpha1().ClusterProfiles(framework.FleetNamespace).UpdateStatus(ctx, cp, metav1.UpdateOptions{})
	require.NoError(t, err)

	start := func(window string) framework.BrokerProcessOptions {
		t.Helper()
		opts := framework.BrokerProcessOptions{Bin: brokerBin, Args: []string{"--agent-reconnect-window=" + window}}
		for _, p := range []*string{&opts.ExchangeAddress, &opts.AgentAddress, &opts.MetricsAddress} {
			*p, err = framework.FreeAddr()
			require.NoError(t, err)
		}
		p, err := deployment.StartBrokerProcess(opts)
		require.NoError(t, err)
		t.Cleanup(p.Stop)
		waitFor(t, time.Minute, "the broker process to answer", func(c assert.TestingT) { assertAlive(c, opts.MetricsAddress) }, p)
		return opts
	}
	opts := start("5m")
	code, body := readyz(t, opts.MetricsAddress)
	assert.Equal(t, http.StatusServiceUnavailable, code)
	assert.Contains(t, body, "waiting for the agents of")

	agent, err := deployment.StartAgentProcess(ctx, spoke1, framework.AgentProcessOptions{
		Bin: agentBin, ClusterProfile: name, BrokerAddresses: []string{opts.AgentAddress},
	})
	require.NoError(t, err)
	t.Cleanup(agent.Stop)
	took := waitFor(t, time.Minute, "the broker to be ready once the agent has found it", func(c assert.TestingT) { assertReady(c, opts.MetricsAddress) }, agent)
	t.Logf("ready %s after the agent started, without waiting the 5m window", took.Round(10*time.Millisecond))

	// Without that agent, the window ends the wait.
	agent.Stop()
	begun := time.Now()
	opts = start("3s")
	waitFor(t, time.Minute, "the broker to be ready once the window is over", func(c assert.TestingT) { assertReady(c, opts.MetricsAddress) })
	assert.GreaterOrEqual(t, time.Since(begun), 3*time.Second, "not before the window is over")
}

// assertAlive states that addr answers /healthz with 200.
func assertAlive(c assert.TestingT, addr string) bool {
	code, body, err := get("http://" + addr + "/healthz")
	return assert.NoError(c, err, "GET %s/healthz", addr) &&
		assert.Equal(c, http.StatusOK, code, "GET %s/healthz: %s", addr, body)
}

func readyz(t *testing.T, addr string) (int, string) {
	t.Helper()
	code, body, err := get("http://" + addr + "/readyz")
	require.NoError(t, err)
	return code, body
}

func get(url string) (int, string, error) {
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Get(url)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, strings.TrimSpace(string(b)), err
}

// deleteClusterProfile deletes the ClusterProfile fleet/name, if it is
// still there.
func deleteClusterProfile(t *testing.T, name string) {
	t.Helper()
	err := env.Hub.Inventory.ApisV1alpha1().ClusterProfiles(framework.FleetNamespace).Delete(context.Background(), name, metav1.DeleteOptions{})
	if !apierrors.IsNotFound(err) {
		assert.NoError(t, err)
	}
}
