package e2e

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/spiffe/go-spiffe/v2/workloadapi"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// rotationWatch records, for one Workload API socket, the serial and
// NotAfter of every X509-SVID it serves.
type rotationWatch struct {
	mu      sync.Mutex
	serials []string
	ends    []time.Time
}

func (w *rotationWatch) OnX509ContextUpdate(c *workloadapi.X509Context) {
	s := c.DefaultSVID()
	if s == nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	leaf := s.Certificates[0]
	if serial := leaf.SerialNumber.String(); len(w.serials) == 0 || w.serials[len(w.serials)-1] != serial {
		w.serials = append(w.serials, serial)
		w.ends = append(w.ends, leaf.NotAfter)
	}
}

func (w *rotationWatch) OnX509ContextWatchError(error) {}

// rotations returns how often the SVID changed and when the first two
// SVIDs ended (zero when not served yet).
func (w *rotationWatch) rotations() (n int, ends [2]time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	copy(ends[:], w.ends)
	return max(len(w.serials)-1, 0), ends
}

// The SPIRE proof: a real SPIRE server and agents on loopback
// (join-token node attestation, unix workload attestation) issue the
// broker's and each spoke agent's SVIDs with a 30s TTL, and a consumer's
// exchanges, each a fresh mint through an agent stream, keep succeeding
// through at least two rotations of every side and past the NotAfter of the
// first two SVIDs of every side, when the streams of those SVIDs end: so
// the streams run on SVIDs that SPIRE rotated, and move to them without a
// gap. Every 100ms the consumer calls for each spoke; a call may be retried
// once on Unavailable, as a client does; none may fail.
//
// Its own hub and spokes, since the suite's broker and agents use files.
func TestSPIREIdentityThroughRotations(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	spire, err := framework.StartSPIRE(ctx, framework.SPIREOptions{X509SVIDTTL: 30 * time.Second})
	require.NoError(t, err)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("SPIRE output:\n%s", spire.Output())
		}
		assert.NoError(t, spire.Stop())
	})
	senv, err := framework.Start(ctx, framework.Options{Spokes: 2})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, senv.Stop()) })

	// Each component has a SPIRE agent of its own, as on its own node, and
	// an entry for its ID parented to that agent (see framework.SPIRE).
	watches := map[string]*rotationWatch{}
	wctx, wcancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	t.Cleanup(func() { wcancel(); wg.Wait() })
	node := func(name, id string) string {
		t.Helper()
		a, err := spire.StartAgent(ctx, name)
		require.NoError(t, err)
		require.NoError(t, a.RegisterWorkload(ctx, id, os.Getuid()))
		w := &rotationWatch{}
		watches[id] = w
		wg.Go(func() { _ = workloadapi.WatchX509Context(wctx, w, workloadapi.WithAddr(a.Endpoint())) })
		return a.Endpoint()
	}
	brokerSocket := node("hub", "spiffe://"+framework.TrustDomain+"/broker")

	lines := &syncBuffer{}
	logger := funcr.New(func(prefix, args string) { lines.WriteString(prefix + " " + args + "\n") }, funcr.Options{})
	dep, err := framework.StartDeployment(ctx, senv, framework.DeploymentOptions{
		Dir: t.TempDir(), Log: logger, Audit: logger.WithName("audit"), MintTimeout: mintTimeout,
		SPIFFEEndpointSocket: brokerSocket,
	})
	require.NoError(t, err)
	t.Cleanup(func() {
		assert.NoError(t, dep.Stop())
		if t.Failed() {
			t.Logf("broker and agent logs:\n%s", lines.String())
		}
	})

	// Every round of calls asks for an audience of its own, so that none is
	// served from the broker's token cache: each is a mint through an agent.
	const maxRounds = 1000
	audiences := make([]string, maxRounds)
	for i := range audiences {
		audiences[i] = fmt.Sprintf("spire-%d", i)
	}
	type target struct {
		spoke  *framework.Cluster
		client consumer
	}
	var targets []target
	for _, spoke := range senv.Spokes {
		id := framework.AgentID(spoke.Name)
		socket := node(spoke.Name, id)
		_, err := dep.StartAgentWith(ctx, spoke, framework.AgentOptions{ID: id, SPIFFEEndpointSocket: socket})
		require.NoError(t, err)

		c := consumer{namespace: "spire-consumer", name: "consumer-" + spoke.Name}
		_, err = senv.Hub.CreateServiceAccount(ctx, c.namespace, c.name, nil)
		require.NoError(t, err)
		require.NoError(t, senv.Hub.GrantClusterProfileToken(ctx, framework.FleetNamespace, spoke.Name, c.namespace, c.name))
		c.token, err = senv.Hub.Token(ctx, c.namespace, c.name, []string{"credbroker"}, time.Hour)
		require.NoError(t, err)
		sa, err := spoke.CreateServiceAccount(ctx, "spire-workload", "workload", map[string]string{
			"credbroker.io/allowed-subjects":  c.username(),
			"credbroker.io/allowed-audiences": strings.Join(audiences, ","),
		})
		require.NoError(t, err)
		require.NoError(t, dep.WaitForServiceAccount(ctx, spoke, sa))
		targets = append(targets, target{spoke, c})
	}

	pem, err := os.ReadFile(dep.CAFile)
	require.NoError(t, err)
	pool := x509.NewCertPool()
	require.True(t, pool.AppendCertsFromPEM(pem))
	conn, err := grpc.NewClient(dep.Broker.ExchangeAddr(),
		grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12})))
	require.NoError(t, err)
	defer conn.Close()
	client := pb.NewTokenExchangeClient(conn)

	// done says whether every side rotated twice and its first two SVIDs
	// have expired.
	done := func() bool {
		for _, w := range watches {
			n, ends := w.rotations()
			if n < 2 || time.Now().Before(ends[1].Add(time.Second)) {
				return false
			}
		}
		return true
	}
	began := time.Now()
	var calls, retried int
	var failures []string
	for i := 0; !done(); i++ {
		require.Less(t, i, maxRounds, "SVIDs did not rotate twice within %d rounds of calls (%s)", maxRounds, time.Since(began))
		for _, tg := range targets {
			req := &pb.ExchangeRequest{Cluster: clusterRef(tg.spoke), Audiences: []string{audiences[i]}}
			calls++
			_, err := exchangeVia(t, client, tg.client, req)
			if status.Code(err) == codes.Unavailable {
				retried++
				_, err = exchangeVia(t, client, tg.client, req)
			}
			if err != nil {
				failures = append(failures, fmt.Sprintf("%s after %s: %v", tg.spoke.Name, time.Since(began).Round(time.Millisecond), err))
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	for id, w := range watches {
		n, ends := w.rotations()
		t.Logf("%s: %d rotations; the first two SVIDs ended %s and %s after the calls began", id, n,
			ends[0].Sub(began).Round(time.Millisecond), ends[1].Sub(began).Round(time.Millisecond))
	}
	t.Logf("%d calls in %s, %d retried once on Unavailable, %d failed", calls, time.Since(began).Round(time.Millisecond), retried, len(failures))
	assert.Empty(t, failures, "no call fails through the rotations")
	for _, tg := range targets {
		assert.Equal(t, 1, dep.Broker.Connected(framework.FleetNamespace, tg.spoke.Name), "%s's agent is connected at the end", tg.spoke.Name)
	}
}
