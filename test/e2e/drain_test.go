package e2e

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/credbroker/credbroker/pkg/identity"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// A consumer that calls every 100 ms, with at most one retry on
// Unavailable to the other replica, sees no failed call while each broker
// replica restarts in turn (each drains: not ready, agents told, calls in
// flight finished, new calls refused) and then each of the ClusterProfile's
// two agents restarts in turn (each says goodbye, finishes its mints, and
// leaves). Every call mints (each asks for an audience of its own), so
// every call crosses an agent stream.
func TestRollingRestartLosesNoCall(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	name := uniqueName(t, "rolling")
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, deployment.ProfileAccess(spoke, framework.FleetNamespace, name))
	require.NoError(t, err)
	c := newConsumer(t, "credbroker", name)
	const maxCalls = 1000
	audiences := make([]string, maxCalls)
	for i := range audiences {
		audiences[i] = fmt.Sprintf("rolling-%d", i)
	}
	ns := optInAudiences(t, spoke, "rolling-sa", audiences, c.username())

	agentOpts := framework.AgentOptions{ID: framework.AgentID(name), Namespace: ns, KeepGrants: true}
	stops := make([]func(), 2)
	for i := range stops {
		stops[i], err = deployment.StartAgentWith(ctx, spoke, agentOpts)
		require.NoError(t, err)
	}
	defer func() {
		// The last agent to stop revokes the test's grants.
		stops[0]()
		last := agentOpts
		last.KeepGrants = false
		stop, err := deployment.StartAgentWith(ctx, spoke, last)
		require.NoError(t, err)
		stops[1]()
		stop()
	}()
	waitStreams := func(replica, n int) time.Duration {
		start := time.Now()
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			assert.GreaterOrEqual(ct, deployment.Brokers[replica].Connected(framework.FleetNamespace, name), n, "agent streams of %s", name)
		},
			30*time.Second, 5*time.Millisecond, "replica %d has fewer than %d streams of %s", replica, n, name)
		return time.Since(start)
	}
	waitStreams(0, 2)
	waitStreams(1, 2)

	// One connection per replica, as a consumer behind the Service would
	// reach either.
	conns := []*grpc.ClientConn{dialExchange(t, deployment.Brokers[0].ExchangeAddr()), dialExchange(t, deployment.Brokers[1].ExchangeAddr())}
	clients := []pb.TokenExchangeClient{pb.NewTokenExchangeClient(conns[0]), pb.NewTokenExchangeClient(conns[1])}

	var (
		calls, failed, retried atomic.Int64
		mu                     sync.Mutex
		failures               []string
		lastOK                 = time.Now()
		longestGap             time.Duration
	)
	call := func(i int) {
		req := &pb.ExchangeRequest{
			Cluster:   &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: name},
			Audiences: []string{audiences[i%maxCalls]},
		}
		first := i % 2
		var err error
		for try := range 2 {
			if try == 1 {
				retried.Add(1)
			}
			cctx, cancel := context.WithTimeout(bearer(c.token), 15*time.Second)
			_, err = clients[(first+try)%2].Exchange(cctx, req)
			cancel()
			if status.Code(err) != codes.Unavailable {
				break
			}
		}
		mu.Lock()
		defer mu.Unlock()
		if err != nil {
			failed.Add(1)
			failures = append(failures, fmt.Sprintf("call %d: %v", i, err))
			return
		}
		now := time.Now()
		longestGap = max(longestGap, now.Sub(lastOK))
		lastOK = now
	}
	stopCalls := make(chan struct{})
	callsDone := make(chan struct{})
	go func() {
		defer close(callsDone)
		var wg sync.WaitGroup
		defer wg.Wait()
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-stopCalls:
				return
			case <-tick.C:
			}
			calls.Add(1)
			wg.Go(func() { call(i) })
		}
	}()
	time.Sleep(time.Second)

	// The brokers restart one after the other, as a rolling update would,
	// each once the other serves again.
	var reconnects []time.Duration
	for i := range deployment.Brokers {
		drained, err := deployment.RestartBroker(i)
		require.NoError(t, err)
		restarted := time.Now()
		t.Logf("broker-%d drained in %s", i, drained.Round(time.Millisecond))
		// Each agent's reconnect: the time until the new replica holds one,
		// then two, streams of the ClusterProfile.
		for n := 1; n <= 2; n++ {
			waitStreams(i, n)
			reconnects = append(reconnects, time.Since(restarted))
		}
		for _, s := range env.Spokes {
			require.EventuallyWithT(t, func(ct *assert.CollectT) {
				assert.GreaterOrEqual(ct, deployment.Brokers[i].Connected(framework.FleetNamespace, s.Name), 1, "agent streams of %s", s.Name)
			},
				30*time.Second, 5*time.Millisecond, "the suite's agent of %s did not come back to broker-%d", s.Name, i)
		}
		waitReady(t, conns[i])
		time.Sleep(time.Second)
	}

	// Then the agents, one after the other.
	for i := range stops {
		stops[i]()
		require.Equal(t, 1, deployment.Brokers[0].Connected(framework.FleetNamespace, name))
		stops[i], err = deployment.StartAgentWith(ctx, spoke, agentOpts)
		require.NoError(t, err)
		waitStreams(0, 2)
		waitStreams(1, 2)
		time.Sleep(time.Second)
	}
	close(stopCalls)
	<-callsDone

	slices.Sort(reconnects)
	t.Logf("calls %d, failed %d, retried %d; agent reconnect after a broker restart: p50 %s, max %s (%d reconnects); longest gap between successful calls %s",
		calls.Load(), failed.Load(), retried.Load(),
		reconnects[len(reconnects)/2].Round(time.Millisecond), reconnects[len(reconnects)-1].Round(time.Millisecond), len(reconnects),
		longestGap.Round(time.Millisecond))
	assert.Zero(t, failed.Load(), "calls failed beyond one retry:\n%s", strings.Join(failures, "\n"))
	assert.Less(t, calls.Load(), int64(maxCalls), "the test ran out of audiences; every call must mint")
}

// Both gRPC ports answer the health service, SERVING, and the metrics port
// answers /healthz and /readyz.
func TestBrokerHealth(t *testing.T) {
	b := deployment.Brokers[1]
	// The agent port takes only SVIDs of the trust domain.
	dir := t.TempDir()
	cert, key, err := deployment.CA.WriteSVID(dir, "spiffe://"+framework.TrustDomain+"/health-checker")
	require.NoError(t, err)
	svid, err := identity.NewFileSource(t.Context(), identity.FileSourceConfig{CertFile: cert, KeyFile: key, BundleFile: deployment.CAFile,
		TrustDomain: deployment.CA.TrustDomain()})
	require.NoError(t, err)
	agentConn, err := grpc.NewClient(b.AgentAddr(), grpc.WithTransportCredentials(
		identity.ClientCredentials(svid, svid, spiffeid.RequireFromPath(deployment.CA.TrustDomain(), "/broker"))))
	require.NoError(t, err)
	t.Cleanup(func() { _ = agentConn.Close() })

	for port, conn := range map[string]*grpc.ClientConn{"exchange": dialExchange(t, b.ExchangeAddr()), "agent": agentConn} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
		cancel()
		require.NoError(t, err, port)
		assert.Equal(t, healthpb.HealthCheckResponse_SERVING, resp.GetStatus(), port)
	}
	for _, path := range []string{"/healthz", "/readyz"} {
		resp, err := http.Get("http://" + b.MetricsAddr() + path)
		require.NoError(t, err)
		_ = resp.Body.Close()
		assert.Equal(t, http.StatusOK, resp.StatusCode, path)
	}
}

// waitReady waits until conn is connected again, as a Service waits for a
// new pod to be ready before the rolling update moves on.
func waitReady(t *testing.T, conn *grpc.ClientConn) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		s := conn.GetState()
		if s == connectivity.Ready {
			return
		}
		conn.Connect()
		if !conn.WaitForStateChange(ctx, s) {
			t.Fatalf("the connection to %s is not ready again: %s", conn.Target(), s)
		}
	}
}
