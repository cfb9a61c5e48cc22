package faults

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/credbroker/credbroker/internal/testing/faultproxy"
	"github.com/credbroker/credbroker/pkg/brokerclient"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// service stands in for a Kubernetes Service in front of broker replicas:
// each new connection goes to one of the replicas whose /readyz answers
// 200 (polled every 100 ms, as endpoints follow readiness), round robin.
type service struct {
	lis      net.Listener
	backends []framework.BrokerProcessOptions
	mu       sync.Mutex
	ready    []bool
	next     int
}

func newService(t *testing.T, backends []framework.BrokerProcessOptions) *service {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	s := &service{lis: lis, backends: backends, ready: make([]bool, len(backends))}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); _ = lis.Close() })
	go func() {
		for ctx.Err() == nil {
			for i, b := range backends {
				ok := ready(b.MetricsAddress)
				s.mu.Lock()
				s.ready[i] = ok
				s.mu.Unlock()
			}
			time.Sleep(100 * time.Millisecond)
		}
	}()
	go func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			go s.forward(c)
		}
	}()
	return s
}

func (s *service) forward(c net.Conn) {
	defer c.Close()
	s.mu.Lock()
	addr := ""
	for range s.backends {
		i := s.next % len(s.backends)
		s.next++
		if s.ready[i] {
			addr = s.backends[i].ExchangeAddress
			break
		}
	}
	s.mu.Unlock()
	if addr == "" {
		return // no ready endpoint: the connection is refused
	}
	up, err := net.Dial("tcp", addr)
	if err != nil {
		return
	}
	defer up.Close()
	go func() { _, _ = io.Copy(up, c); _ = up.(*net.TCPConn).CloseWrite() }()
	_, _ = io.Copy(c, up)
}

// A rolling restart of both broker replicas, one at a time as the
// Deployment does it, under 64 consumers behind the Service: no call fails.
// The Service here hides the consumers' addresses, as a node's SNAT does,
// so a restarted replica, whose caches are empty, meets the per-address
// review limit; the consumers wait out its retry-after as the plugin and
// pkg/client do.
// The replicas run as the shipped binary with deploy/hub's drain settings
// and publish the access provider, so that a restarted replica turns
// ready once the agent has found it, here 5 s after its restart; the agent
// is the shipped binary too, with its default backoff. Before: a replica
// turned ready before its agent came back, and the calls of consumers sent
// there whose token it had not cached failed with Unavailable.
//
// With SVIDs of 90 s for the replicas and the agent, which the test renews
// at half their life as a SPIFFE source would, the replicas' readiness
// must not flap (it needs a quarter of the SVID's lifetime left), and the
// agent's streams, which end when the SVID they were opened with expires,
// come back while the consumers call: the load lasts past the first
// SVIDs' expiry. With readiness needing a fixed minute of SVID left, as
// before its margin became a quarter of a short SVID's lifetime, 5,013 of
// 37,797 calls failed: both replicas were not ready for the last 15 s
// before each renewal.
func TestRollingRestartUnderLoad(t *testing.T) {
	for _, tc := range []struct {
		name string
		// svidTTL is the lifetime of the SVIDs; 0 keeps the
		// deployment's, of an hour.
		svidTTL time.Duration
	}{
		{"SVIDs of an hour", 0},
		{"SVIDs of 90s, renewed at half life", 90 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) { testRollingRestart(t, tc.svidTTL) })
	}
}

// rotateSVIDs issues the brokers and the agent of the ClusterProfile name
// SVIDs valid for ttl into a directory of the test's, again every ttl/2
// until the test ends, and returns the flags that make a broker and an
// agent read them, and how many times they were issued.
func rotateSVIDs(t *testing.T, name string, ttl time.Duration) (brokerArgs, agentArgs []string, issued *atomic.Int64) {
	t.Helper()
	dir := t.TempDir()
	issued = &atomic.Int64{}
	issue := func() (brokerArgs, agentArgs []string, err error) {
		bc, bk, err := deployment.CA.WriteSVIDFor(dir, framework.BrokerID(), ttl)
		if err != nil {
			return nil, nil, err
		}
		ac, ak, err := deployment.CA.WriteSVIDFor(dir, framework.AgentID(name), ttl)
		issued.Add(1)
		return []string{"--svid-cert-file=" + bc, "--svid-key-file=" + bk}, []string{"--svid-cert-file=" + ac, "--svid-key-file=" + ak}, err
	}
	brokerArgs, agentArgs, err := issue()
	require.NoError(t, err)
	stop := make(chan struct{})
	done := make(chan struct{})
	t.Cleanup(func() { close(stop); <-done })
	go func() {
		defer close(done)
		ticker := time.NewTicker(ttl / 2)
		defer ticker.Stop()
		for {
			select {
			case <-stop:
				return
			case <-ticker.C:
				if _, _, err := issue(); err != nil {
					t.Errorf("renew the SVIDs: %v", err)
				}
			}
		}
	}()
	return brokerArgs, agentArgs, issued
}

func testRollingRestart(t *testing.T, svidTTL time.Duration) {
	ctx := t.Context()
	name := unique("rolling")
	var brokerSVID, agentSVID []string
	var issued *atomic.Int64
	if svidTTL > 0 {
		brokerSVID, agentSVID, issued = rotateSVIDs(t, name, svidTTL)
	}
	loadStart := time.Now()
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, deployment.ProfileAccess(spoke1, framework.FleetNamespace, name))
	require.NoError(t, err)
	// Its CredentialBrokerConnected condition outlives the test, and would
	// make every broker that starts later wait for its agent.
	t.Cleanup(func() { deleteClusterProfile(t, name) })
	lease := unique("rolling-lease")
	replicas := make([]framework.BrokerProcessOptions, 2)
	procs := make([]*framework.Process, 2)
	audits := make([]string, 2)
	for i := range replicas {
		audits[i] = filepath.Join(t.TempDir(), "audit.log")
		r := framework.BrokerProcessOptions{Bin: brokerBin, Args: []string{
			"--agent-reconnect-window=45s", "--shutdown-delay=3s", "--shutdown-grace=15s",
			"--publish-access-provider", "--publish-lease-namespace=default", "--publish-lease-name=" + lease,
			fmt.Sprintf("--publish-identity=replica-%d", i),
			"--audit-log-path=" + audits[i],
		}}
		r.Args = append(r.Args, brokerSVID...)
		for _, p := range []*string{&r.ExchangeAddress, &r.AgentAddress, &r.MetricsAddress} {
			*p, err = framework.FreeAddr()
			require.NoError(t, err)
		}
		replicas[i] = r
		procs[i], err = deployment.StartBrokerProcess(r)
		require.NoError(t, err)
	}
	t.Cleanup(func() {
		for _, p := range procs {
			p.Stop()
		}
	})
	// The agent reaches each replica through a path the test can cut, as
	// if a new replica's address were not in the agent's DNS answer yet.
	paths := make([]*faultproxy.Proxy, len(replicas))
	for i, r := range replicas {
		paths[i], err = faultproxy.New(r.AgentAddress)
		require.NoError(t, err)
		t.Cleanup(func() { _ = paths[i].Close() })
	}
	agent, err := deployment.StartAgentProcess(ctx, spoke1, framework.AgentProcessOptions{
		Bin: agentBin, ClusterProfile: name, BrokerAddresses: []string{paths[0].Addr(), paths[1].Addr()}, Args: agentSVID,
	})
	require.NoError(t, err)
	t.Cleanup(agent.Stop)
	for _, r := range replicas {
		waitFor(t, 2*time.Minute, "both replicas to be ready", func(c assert.TestingT) { assertReady(c, r.MetricsAddress) }, procs...)
	}
	svc := newService(t, replicas)

	// 64 consumers in four hub namespaces, each with its own connections
	// through the Service, as pods with credbroker-plugin or pkg/client.
	spokeNS := unique("rolling-spoke")
	var groups []string
	consumers := make([]framework.Consumer, 64)
	for i := range consumers {
		if i%16 == 0 {
			groups = append(groups, "group:system:serviceaccounts:"+unique("rolling"))
		}
		consumers[i], err = env.NewConsumer(ctx, strings.TrimPrefix(groups[len(groups)-1], "group:system:serviceaccounts:"), fmt.Sprintf("c-%d", i), "credbroker", name)
		require.NoError(t, err)
	}
	require.NoError(t, spoke1.EnsureNamespace(ctx, spokeNS))
	require.NoError(t, deployment.OptIn(ctx, spoke1, spokeNS, "target", groups...))
	caPEM, err := os.ReadFile(deployment.CAFile)
	require.NoError(t, err)
	roots := x509.NewCertPool()
	require.True(t, roots.AppendCertsFromPEM(caPEM))
	creds, err := brokerclient.TLSCredentials(&tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12})
	require.NoError(t, err)

	var (
		calls, failed, waits atomic.Int64
		mu                   sync.Mutex
		failures             []string
		stop                 = make(chan struct{})
		wg                   sync.WaitGroup
	)
	// Half of them keep one connection, as a controller with pkg/client
	// does; the other half dial for every call, as credbroker-plugin does
	// for each run, and so reach a restarted replica at once.
	dial := func() (pb.TokenExchangeClient, func()) {
		conn, err := brokerclient.Dial(svc.lis.Addr().String(), creds, "rolling-test")
		require.NoError(t, err)
		return pb.NewTokenExchangeClient(conn), func() { _ = conn.Close() }
	}
	for i, c := range consumers {
		perCall := i%2 == 1
		client, closeConn := dial()
		t.Cleanup(closeConn)
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				case <-time.After(100 * time.Millisecond):
				}
				if perCall {
					closeConn()
					client, closeConn = dial()
				}
				// As credbroker-plugin and pkg/client do: a refusal
				// with a retry-after is waited out, not returned.
				cctx, cancel := context.WithTimeout(c.Context(ctx), time.Minute)
				_, err := brokerclient.WaitAndRetry(cctx, 30*time.Second, nil, func() (*pb.ExchangeResponse, time.Duration, error) {
					var trailer metadata.MD
					resp, err := client.Exchange(cctx, &pb.ExchangeRequest{
						Cluster:        &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: name},
						ServiceAccount: &pb.ObjectReference{Namespace: spokeNS, Name: "target"},
					}, grpc.Trailer(&trailer))
					wait, _ := brokerclient.RetryAfter(err, trailer)
					if wait > 0 {
						waits.Add(1)
					}
					return resp, wait, err
				})
				cancel()
				calls.Add(1)
				if err != nil {
					failed.Add(1)
					mu.Lock()
					failures = append(failures, status.Convert(err).String())
					mu.Unlock()
				}
			}
		})
	}

	// Roll: each replica in turn gets SIGTERM, drains, exits, and comes
	// back on its ports, where the agent finds it only 5 s later; the next
	// goes only once it is ready again.
	time.Sleep(2 * time.Second)
	for i, r := range replicas {
		require.NoError(t, procs[i].Signal(syscall.SIGTERM))
		require.NoError(t, procs[i].Wait(), "replica %d drains and exits 0", i)
		paths[i].Down()
		time.AfterFunc(5*time.Second, paths[i].Heal)
		procs[i], err = deployment.StartBrokerProcess(r)
		require.NoError(t, err)
		took := waitFor(t, 2*time.Minute, "the restarted replica to be ready", func(c assert.TestingT) { assertReady(c, r.MetricsAddress) }, procs[i])
		t.Logf("replica %d ready %s after its restart", i, took.Round(10*time.Millisecond))
		time.Sleep(2 * time.Second) // calls reach it
	}
	if svidTTL > 0 {
		// Past the expiry of the first SVIDs, and of the streams opened
		// with them.
		time.Sleep(time.Until(loadStart.Add(svidTTL + 10*time.Second)))
	}
	// The agent's streams: one to each replica at the start and after its
	// restart, and one more to each at every renewal of the SVIDs, opened
	// with the new SVID before the old stream drains.
	connected := 0
	for _, a := range audits {
		b, err := os.ReadFile(a)
		require.NoError(t, err)
		connected += strings.Count(string(b), `"agent connected"`)
	}
	t.Logf("the agent's streams connected %d times", connected)
	if svidTTL > 0 {
		t.Logf("SVIDs of %s issued %d times", svidTTL, issued.Load())
		assert.GreaterOrEqual(t, connected, 2*len(replicas)+len(replicas), "the agent opened no stream with a renewed SVID")
	}
	close(stop)
	wg.Wait()
	t.Logf("%d calls through the rolling restart, %d failed; %d refusals by a review limit were waited out", calls.Load(), failed.Load(), waits.Load())
	assert.Zero(t, failed.Load(), "calls that failed:\n%s", strings.Join(failures[:min(len(failures), 10)], "\n"))
}
