package e2e

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/credbroker/credbroker/internal/testing/fakeworkload"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// Rotation without a gap. A consumer calls every 100 ms, alternating
// between the two brokers, each time over a new connection (a new TLS
// handshake with the exchange port's certificate of the moment), with a new
// audience so that every call mints. Meanwhile the agent's SVID, valid for
// agentTTL, is rewritten every agentTTL/2, and the brokers' SVID and
// exchange certificate, valid for brokerTTL, every brokerTTL/2: a stream
// or a certificate that did not rotate would outlive its identity and
// fail. Each call may be retried once on Unavailable; none may fail.
func TestRotationWithoutAGap(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	name := uniqueName(t, "rotating")
	const (
		agentTTL  = 6 * time.Second
		brokerTTL = 14 * time.Second // the brokers read their files every 5 s
		duration  = 21 * time.Second
		interval  = 100 * time.Millisecond
	)
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, deployment.ProfileAccess(spoke, framework.FleetNamespace, name))
	require.NoError(t, err)
	c := newConsumer(t, "credbroker", name)
	audiences := make([]string, int(duration/interval)+20)
	for i := range audiences {
		audiences[i] = fmt.Sprintf("rotation-%d", i)
	}
	ns := optInAudiences(t, spoke, "rotating-sa", audiences, c.username())

	lines := &syncBuffer{}
	log := funcr.New(func(prefix, args string) { lines.WriteString(prefix + " " + args + "\n") }, funcr.Options{})
	id := framework.AgentID(name)
	stop, err := deployment.StartAgentWith(ctx, spoke, framework.AgentOptions{
		ID: id, SVIDTTL: agentTTL, FileCheckInterval: 100 * time.Millisecond, Log: &log,
	})
	require.NoError(t, err)
	t.Cleanup(stop)
	// Whatever happens, the agent and the shared brokers end with long-lived
	// certificates, served before the agent stops (cleanups run last
	// first): its revokes of the grants it minted need its streams, which
	// an SVID of agentTTL would close a few seconds after the last rotation.
	t.Cleanup(func() {
		err := deployment.WriteAgentSVID(spoke, id, deployment.CA, time.Hour)
		assert.NoError(t, err)
		assert.NoError(t, deployment.WriteBrokerSVID(time.Hour))
		assert.NoError(t, deployment.WriteBrokerServing(time.Hour))
		assert.NoError(t, deployment.WaitForBrokerCertificates(ctx, 30*time.Minute))
		for i, b := range deployment.Brokers {
			assert.EventuallyWithT(t, func(ct *assert.CollectT) {
				assert.Equal(ct, 1, b.Connected(framework.FleetNamespace, name), "agent streams of %s", name)
			}, 30*time.Second, 20*time.Millisecond,
				"replica %d lost the agent after the rotations", i)
		}
	})
	for i, b := range deployment.Brokers {
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			assert.Equal(ct, 1, b.Connected(framework.FleetNamespace, name), "agent streams of %s", name)
		}, 10*time.Second, 20*time.Millisecond,
			"replica %d never admits the agent", i)
	}

	runCtx, cancel := context.WithTimeout(ctx, duration)
	defer cancel()
	var wg sync.WaitGroup

	// The longest time each broker had no stream of the agent that takes
	// requests.
	gaps := make([]time.Duration, len(deployment.Brokers))
	for i, b := range deployment.Brokers {
		wg.Go(func() {
			var since time.Time
			for runCtx.Err() == nil {
				now := time.Now()
				if b.Connected(framework.FleetNamespace, name) == 0 {
					if since.IsZero() {
						since = now
					}
					gaps[i] = max(gaps[i], now.Sub(since))
				} else {
					since = time.Time{}
				}
				time.Sleep(2 * time.Millisecond)
			}
		})
	}
	rotateEvery := func(every time.Duration, rotate func() error) {
		wg.Go(func() {
			tick := time.NewTicker(every)
			defer tick.Stop()
			for {
				if err := rotate(); err != nil {
					t.Errorf("rotate: %v", err)
				}
				select {
				case <-runCtx.Done():
					return
				case <-tick.C:
				}
			}
		})
	}
	rotateEvery(brokerTTL/2, func() error {
		return errors.Join(deployment.WriteBrokerSVID(brokerTTL), deployment.WriteBrokerServing(brokerTTL))
	})
	time.Sleep(agentTTL / 2)
	rotateEvery(agentTTL/2, func() error {
		return deployment.WriteAgentSVID(spoke, id, deployment.CA, agentTTL)
	})

	pemCA, err := os.ReadFile(deployment.CAFile)
	require.NoError(t, err)
	pool := x509.NewCertPool()
	require.True(t, pool.AppendCertsFromPEM(pemCA))
	call := func(addr, audience string) (*pb.ExchangeResponse, *x509.Certificate, error) {
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12})))
		if err != nil {
			return nil, nil, err
		}
		defer conn.Close()
		var p peer.Peer
		cctx, ccancel := context.WithTimeout(bearer(c.token), 30*time.Second)
		defer ccancel()
		resp, err := pb.NewTokenExchangeClient(conn).Exchange(cctx, &pb.ExchangeRequest{
			Cluster:        &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: name},
			ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: "rotating-sa"},
			Audiences:      []string{audience},
		}, grpc.Peer(&p))
		if err == nil {
			minted.Lock()
			minted.tokens = append(minted.tokens, resp.GetToken())
			minted.Unlock()
		}
		var served *x509.Certificate
		if info, ok := p.AuthInfo.(credentials.TLSInfo); ok && len(info.State.PeerCertificates) > 0 {
			served = info.State.PeerCertificates[0]
		}
		return resp, served, err
	}

	var calls, retried, failed int
	var failures []string
	servingCerts := map[string]bool{} // the exchange port's certificates seen, by serial
	tick := time.NewTicker(interval)
	for i := 0; runCtx.Err() == nil; i++ {
		addr := deployment.Brokers[i%len(deployment.Brokers)].ExchangeAddr()
		calls++
		resp, served, err := call(addr, audiences[i])
		if status.Code(err) == codes.Unavailable {
			retried++
			resp, served, err = call(addr, audiences[i])
		}
		if served != nil {
			servingCerts[served.SerialNumber.String()] = true
		}
		if err != nil || resp.GetToken() == "" {
			failed++
			failures = append(failures, fmt.Sprintf("call %d to %s: %v", i, addr, err))
		}
		<-tick.C
	}
	tick.Stop()
	cancel()
	wg.Wait()

	t.Logf("rotation: %d calls, %d retried once on Unavailable, %d failed; longest gap without a stream per broker: %v; "+
		"exchange certificates served: %d", calls, retried, failed, gaps, len(servingCerts))
	assert.Zero(t, failed, "calls failed during rotation:\n%s", strings.Join(failures, "\n"))
	// The agent did rotate its streams, on both brokers, at least twice.
	assert.GreaterOrEqual(t, strings.Count(lines.String(), "draining the stream of the old SVID"), 2*len(deployment.Brokers),
		"the agent never drained a stream for a rotation")
	// The exchange port served the first certificate and at least two
	// rotated ones, each to a new handshake.
	assert.GreaterOrEqual(t, len(servingCerts), 3, "the exchange port's certificate did not rotate in place")
	for i, gap := range gaps {
		assert.Zero(t, gap, "replica %d was without a stream of the agent for %v", i, gap)
	}
}

// An agent on the SPIFFE Workload API: the API serves this test process
// the SVIDs of several agents, and the agent takes its own. When the API
// pushes a rotated SVID, the agent renews its streams to both brokers
// without a gap, as with files. (The real SPIRE runs in the SPIRE test; this
// one uses a fake Workload API to push rotations at will.)
func TestWorkloadAPIAgentRotates(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[1]
	name := uniqueName(t, "workload-api")
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, deployment.ProfileAccess(spoke, framework.FleetNamespace, name))
	require.NoError(t, err)
	api, err := fakeworkload.Start()
	require.NoError(t, err)
	defer api.Stop()
	issue := func(id string) fakeworkload.SVID {
		cert, key, err := deployment.CA.IssueSVID(id, time.Hour)
		require.NoError(t, err)
		return fakeworkload.SVID{CertPEM: cert, KeyPEM: key}
	}
	id := framework.AgentID(name)
	// Another agent's SVID comes first: the default pick would take it.
	require.NoError(t, api.Set(deployment.CA.BundlePEM(), issue(framework.AgentID("someone-else")), issue(id)))

	lines := &syncBuffer{}
	log := funcr.New(func(prefix, args string) { lines.WriteString(prefix + " " + args + "\n") }, funcr.Options{})
	stop, err := deployment.StartAgentWith(ctx, spoke, framework.AgentOptions{ID: id, SPIFFEEndpointSocket: api.Addr(), Log: &log})
	require.NoError(t, err)
	defer stop()
	c := newConsumer(t, "credbroker", name)
	optInAudiences(t, spoke, "wl-sa", []string{"wl-0", "wl-1", "wl-2", "wl-3"}, c.username())
	ref := &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: name}
	for i, b := range deployment.Brokers {
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			assert.Equal(ct, 1, b.Connected(framework.FleetNamespace, name), "agent streams of %s", name)
		}, 10*time.Second, 20*time.Millisecond)
		_, err := exchangeVia(t, exchangeClientAt(t, b.ExchangeAddr()), c, &pb.ExchangeRequest{Cluster: ref, Audiences: []string{fmt.Sprintf("wl-%d", i)}})
		require.NoError(t, err, "replica %d", i)
	}

	require.NoError(t, api.Set(deployment.CA.BundlePEM(), issue(framework.AgentID("someone-else")), issue(id)))
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		log := lines.String()
		assert.GreaterOrEqual(ct, strings.Count(log, "draining the stream of the old SVID"), len(deployment.Brokers),
			"the agent's drained streams; its last lines:\n%s", framework.LastLines(log, 20))
	}, 20*time.Second, 20*time.Millisecond, "the agent never renewed its streams after the Workload API rotated its SVID")
	for i, b := range deployment.Brokers {
		assert.Equal(t, 1, b.Connected(framework.FleetNamespace, name), "replica %d", i)
		_, err := exchangeVia(t, exchangeClientAt(t, b.ExchangeAddr()), c, &pb.ExchangeRequest{Cluster: ref, Audiences: []string{fmt.Sprintf("wl-%d", i+2)}})
		require.NoError(t, err, "replica %d after the rotation", i)
	}
}
