package binaries

import (
	"context"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// shutdownDelay is the drained broker's --shutdown-delay: long enough for
// the test to see every step of the drain while it lasts, on a loaded
// machine.
const shutdownDelay = 6 * time.Second

// On SIGTERM a broker drains in order: at once it is not ready (/readyz),
// NOT_SERVING on gRPC health, and its agents are told; for
// --shutdown-delay it still serves new calls, so that consumers that have
// not yet seen it leave lose nothing; then its exchange port refuses new
// calls, and it exits 0 within --shutdown-grace. A broker and an agent of
// their own, so that the suite's keep serving.
func TestDrainOnSIGTERM(t *testing.T) {
	dir := t.TempDir()
	b, err := launchBroker(t.Context(), dir, "--shutdown-delay="+shutdownDelay.String(), "--shutdown-grace=30s")
	require.NoError(t, err)
	t.Cleanup(b.Stop)
	a, _, err := launchAgent(t.Context(), dir, b.agent, "--shutdown-grace=2s")
	require.NoError(t, err)
	t.Cleanup(a.Stop)

	client, conn, err := deployment.ExchangeClient(b.exchange)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	c := newConsumer(t, spoke.Name)
	// Each call asks for an audience of its own: each is a mint.
	ns := unique("spoke")
	_, err = spoke.CreateServiceAccount(t.Context(), ns, "drained", map[string]string{
		"credbroker.io/allowed-subjects":  c.Username(),
		"credbroker.io/allowed-audiences": "before,during-the-delay,after-the-delay",
	})
	require.NoError(t, err)
	req := func(audience string) *pb.ExchangeRequest {
		return &pb.ExchangeRequest{
			Cluster: clusterRef(spoke.Name), ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: "drained"}, Audiences: []string{audience},
		}
	}
	_, err = callOnceSeen(t, client, c, req("before"))
	require.NoError(t, err)
	health := healthpb.NewHealthClient(conn)
	assert.Equal(t, healthpb.HealthCheckResponse_SERVING, healthStatus(t, health))

	require.NoError(t, b.Signal(syscall.SIGTERM))
	signalled := time.Now()

	// At once NOT_SERVING; and still, within the delay, a new call (a new
	// mint) is served.
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		assert.Equal(ct, healthpb.HealthCheckResponse_NOT_SERVING, healthStatus(t, health), "gRPC health (UNKNOWN: no answer)%s", b.TailContext(20))
	}, shutdownDelay/2, 20*time.Millisecond, "gRPC health is not NOT_SERVING")
	_, err = callOnce(t, client, c, req("during-the-delay"))
	require.NoError(t, err, "a call during --shutdown-delay (%s after SIGTERM)", time.Since(signalled))
	// Not ready, and the agent told.
	code, body, err := get(t.Context(), "http://"+b.metrics+"/readyz")
	require.NoError(t, err)
	assert.Equal(t, http.StatusServiceUnavailable, code)
	assert.Contains(t, body, "draining")
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		assert.True(ct, strings.Contains(a.Output(), "broker is draining"), "no %q in the agent's log%s", "broker is draining", a.TailContext(20))
	}, shutdownDelay/2, 20*time.Millisecond, "the agent was not told")

	// After it: new calls are refused, and the process exits 0.
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		_, err := callOnce(t, client, c, req("after-the-delay"))
		assert.Equal(ct, codes.Unavailable, status.Code(err), "an exchange after the delay: %v%s", err, b.TailContext(20))
	}, 30*time.Second, 100*time.Millisecond, "the exchange port still serves after the delay")
	assert.GreaterOrEqual(t, time.Since(signalled), shutdownDelay, "new calls were refused before the delay was over")
	require.NoError(t, b.Wait(), "the broker's exit")
	out := b.Output()
	draining, drained := strings.Index(out, `"broker draining"`), strings.Index(out, `"broker drained"`)
	assert.True(t, draining >= 0 && drained > draining, "the broker's log says it drained, in order:\n%s", out)
}

// healthStatus asks the gRPC health service of conn's server.
func healthStatus(t *testing.T, health healthpb.HealthClient) healthpb.HealthCheckResponse_ServingStatus {
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	resp, err := health.Check(ctx, &healthpb.HealthCheckRequest{}, grpc.WaitForReady(false))
	if err != nil {
		return healthpb.HealthCheckResponse_UNKNOWN
	}
	return resp.GetStatus()
}
