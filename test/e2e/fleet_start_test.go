package e2e

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/credbroker/credbroker/pkg/broker"
	"github.com/credbroker/credbroker/pkg/brokerclient"
	"github.com/credbroker/credbroker/pkg/client"
	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/plugin"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

const (
	// fleetSize is the number of ClusterProfiles the controller starts with.
	fleetSize = 1000
	// fleetWorkers is the controller's concurrency at start-up.
	fleetWorkers = 64
)

// exchangeAudit counts a broker's audit lines by code and cache hit, and
// the agent streams that ended by why.
type exchangeAudit struct {
	mu      sync.Mutex
	minted  int // OK, not from the cache
	cached  int // OK, from the cache
	refused map[string]int
	ended   map[string]int
}

func (a *exchangeAudit) add(line string) {
	var rec struct {
		Msg, Code, Reason string
		CacheHit          bool
	}
	if json.Unmarshal([]byte(line), &rec) != nil {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	switch {
	case rec.Msg == "agent disconnected":
		a.ended[rec.Code+": "+rec.Reason]++
	case rec.Msg != "exchange":
	case rec.Code == codes.OK.String() && rec.CacheHit:
		a.cached++
	case rec.Code == codes.OK.String():
		a.minted++
	default:
		a.refused[rec.Code]++
	}
}

// take returns the counts so far and starts again from zero.
func (a *exchangeAudit) take() (minted, cached int, refused map[string]int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	minted, cached, refused = a.minted, a.cached, a.refused
	a.minted, a.cached, a.refused = 0, 0, map[string]int{}
	return minted, cached, refused
}

// streamsEnded returns the agent streams that ended so far, by why.
func (a *exchangeAudit) streamsEnded() map[string]int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return maps.Clone(a.ended)
}

// A fleet starts all at once: a controller on the hub with 1,000
// ClusterProfiles asks, at start-up, for a token for each of them, through
// pkg/client, from a real broker with the default per-consumer rate limit.
// Each ClusterProfile's agent is simulated (test/fleetagents: all in one
// helper process, each over its own SPIFFE mTLS connection with its own SVID) and answers
// with a made-up token: what is under test is the broker's rate limit and
// caches at start-up, not TokenRequest.
//
//   - Cold start: 1,000 SubjectAccessReviews and 1,000 mints fit the
//     default burst: no exchange is refused, and every token is minted once.
//   - Restart of the controller (a new client, so nothing cached in it): every
//     answer comes from the broker's token cache, and none reaches the
//     controller as an error.
//   - Beyond the limit: a consumer that keeps asking for new tokens is
//     refused with ResourceExhausted and a retry-after trailer, and the same
//     call succeeds once it has waited that long; pkg/client waits as told,
//     so its caller sees no error.
//
// The durations of the two passes are logged (no timing is asserted).
func TestFleetStartsAllAtOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("starts 1,000 simulated agents")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dir := t.TempDir()
	// The ClusterProfiles live in a namespace of their own, apart from the
	// suite's fleet.
	namespace := uniqueName(t, "fleet-start")

	// The simulated agents run outside the race-enabled test binary.
	agentsBin := filepath.Join(dir, "fleetagents")
	require.NoError(t, framework.Build(ctx, dir, framework.Module+"/test/fleetagents"))

	// 1,000 ClusterProfiles, each naming a spoke server of its own.
	names := make([]string, fleetSize)
	for i := range names {
		names[i] = fmt.Sprintf("cluster-%04d", i)
	}
	t.Cleanup(func() {
		_ = env.Hub.Inventory.ApisV1alpha1().ClusterProfiles(namespace).DeleteCollection(context.Background(),
			metav1.DeleteOptions{}, metav1.ListOptions{})
	})
	parallel(t, names, 32, func(name string) error {
		ext, _ := json.Marshal(plugin.ExecConfig{ClusterProfile: &plugin.Reference{Namespace: namespace, Name: name}})
		_, err := env.Hub.CreateClusterProfile(ctx, namespace, name, &framework.Access{
			ProviderName: plugin.Name, Server: "https://" + name + ".fleet.test:6443", CAData: env.Spokes[0].CAData, ExecConfig: ext,
		})
		return err
	})

	// The controller may ask for any ClusterProfile of the namespace.
	c := consumer{namespace: namespace, name: "controller"}
	_, err := env.Hub.CreateServiceAccount(ctx, c.namespace, c.name, nil)
	require.NoError(t, err)
	require.NoError(t, env.Hub.Grant(ctx, namespace, framework.ServiceAccountSubject(c.namespace, c.name), []rbacv1.PolicyRule{{
		APIGroups: []string{"multicluster.x-k8s.io"}, Resources: []string{"clusterprofiles/token"}, Verbs: []string{"create"},
	}}))
	c.token, err = env.Hub.Token(ctx, c.namespace, c.name, []string{"credbroker"}, time.Hour)
	require.NoError(t, err)

	// A broker of its own, with the default rate limits.
	audit := &exchangeAudit{refused: map[string]int{}, ended: map[string]int{}}
	cfg := deployment.BrokerConfig()
	def := broker.Default()
	cfg.RateLimit, cfg.RateBurst = def.RateLimit, def.RateBurst
	// This broker runs in the race-enabled test binary, beside the other
	// packages' API servers: on a loaded CI machine it answers its 1,000
	// agents' keepalive pings seconds late, and with the default 3 s its
	// keepalives end the streams, which then reconnect all at once (9,300
	// stream ends in one run with the machine's cores four times
	// oversubscribed). The shipped binary's herd is measured by make
	// bench-fleet; what is under test here is the rate limit and caches.
	cfg.AgentKeepaliveTimeout, cfg.MintTimeout = 20*time.Second, 30*time.Second
	cfg.Audit = funcr.NewJSON(func(obj string) { audit.add(obj) }, funcr.Options{})
	b, err := broker.New(cfg)
	require.NoError(t, err)
	bctx, stopBroker := context.WithCancel(context.Background())
	brokerDone := make(chan error, 1)
	go func() { brokerDone <- b.Run(bctx) }()
	t.Cleanup(func() {
		stopBroker()
		assert.NoError(t, <-brokerDone)
	})

	// Their agents: one SVID each.
	svids := filepath.Join(dir, "svids")
	require.NoError(t, os.Mkdir(svids, 0o700))
	for _, name := range names {
		certPEM, keyPEM, err := deployment.CA.IssueSVID(
			"spiffe://"+framework.TrustDomain+"/clusterprofile/"+namespace+"/"+name, time.Hour)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(svids, name+".crt"), certPEM, 0o600))
		require.NoError(t, os.WriteFile(filepath.Join(svids, name+".key"), keyPEM, 0o600))
	}
	agents := exec.Command(agentsBin, "--broker-address="+b.AgentAddr(), "--svid-dir="+svids,
		"--trust-bundle-file="+deployment.CAFile, "--trust-domain="+framework.TrustDomain)
	stdin, err := agents.StdinPipe()
	require.NoError(t, err)
	stdout, err := agents.StdoutPipe()
	require.NoError(t, err)
	agents.Stderr = os.Stderr
	require.NoError(t, agents.Start())
	lines := bufio.NewScanner(stdout)
	stopAgents := sync.OnceValue(func() string {
		_ = stdin.Close()
		var last string
		for lines.Scan() {
			last = lines.Text()
		}
		_ = agents.Wait()
		return last
	})
	t.Cleanup(func() { stopAgents() })
	began := time.Now()
	require.True(t, lines.Scan(), "the simulated agents stopped before they were admitted")
	require.Equal(t, fmt.Sprintf("admitted %d", fleetSize), lines.Text())
	t.Logf("%d simulated agents admitted in %s", fleetSize, time.Since(began).Round(time.Millisecond))
	require.Equal(t, 1, b.Connected(namespace, names[fleetSize-1]))

	roots, err := brokerclient.LoadCAFile(deployment.CAFile)
	require.NoError(t, err)
	newClient := func() *client.Client {
		gc, err := client.New(client.Config{
			Address:     b.ExchangeAddr(),
			TLS:         &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12},
			TokenSource: client.StaticTokenSource(c.token),
		})
		require.NoError(t, err)
		t.Cleanup(func() { _ = gc.Close() })
		return gc
	}
	fetchAll := func(t *testing.T, gc *client.Client) time.Duration {
		began := time.Now()
		parallel(t, names, fleetWorkers, func(name string) error {
			cfg, err := gc.RESTConfigFor(ctx, namespace, name)
			if err != nil {
				return err
			}
			if want := "https://" + name + ".fleet.test:6443"; cfg.Host != want {
				return fmt.Errorf("host %s, want %s", cfg.Host, want)
			}
			return nil
		})
		return time.Since(began)
	}

	t.Run("a cold start of 1,000 clusters is not refused", func(t *testing.T) {
		took := fetchAll(t, newClient())
		minted, cached, refused := audit.take()
		t.Logf("cold: %d tokens in %s (%d minted, %d from the cache)", fleetSize, took.Round(time.Millisecond), minted, cached)
		assert.Empty(t, refused, "exchanges refused within the default limit")
		assert.Equal(t, fleetSize, minted)
	})

	t.Run("a restarted controller gets every token from the broker's cache", func(t *testing.T) {
		took := fetchAll(t, newClient())
		minted, cached, refused := audit.take()
		t.Logf("cached: %d tokens in %s (%d minted, %d from the cache, refused and waited: %v)",
			fleetSize, took.Round(time.Millisecond), minted, cached, refused)
		assert.Zero(t, minted)
		assert.Equal(t, fleetSize, cached)
	})

	t.Run("beyond the limit, the consumer is told how long to wait, and that is enough", func(t *testing.T) {
		x := pb.NewTokenExchangeClient(dialExchange(t, b.ExchangeAddr()))
		cluster := &pb.ObjectReference{Namespace: namespace, Name: names[0]}
		var refusedReq *pb.ExchangeRequest
		var trailer metadata.MD
		// Every new audience is a new mint: spend what is left of the burst.
		for i := 0; refusedReq == nil && i < 3*def.RateBurst; i++ {
			req := &pb.ExchangeRequest{Cluster: cluster, Audiences: []string{"over-" + strconv.Itoa(i)}}
			var tr metadata.MD
			cctx, cancel := context.WithTimeout(bearer(c.token), 30*time.Second)
			_, err := x.Exchange(cctx, req, grpc.Trailer(&tr))
			cancel()
			switch status.Code(err) {
			case codes.OK:
			case codes.ResourceExhausted:
				refusedReq, trailer = req, tr
			default:
				require.NoError(t, err)
			}
		}
		require.NotNil(t, refusedReq, "never refused")
		wait, ok := errdefs.ParseRetryAfter(trailer)
		require.True(t, ok, "no retry-after trailer: %v", trailer)
		require.Positive(t, wait)
		time.Sleep(wait)
		cctx, cancel := context.WithTimeout(bearer(c.token), 30*time.Second)
		defer cancel()
		_, err := x.Exchange(cctx, refusedReq)
		require.NoError(t, err, "refused again after waiting the retry-after")

		// pkg/client waits as told: a controller that asks for 60 more
		// tokens now (each a new mint) gets them all, later.
		audit.take()
		gc, err := client.New(client.Config{
			Address:     b.ExchangeAddr(),
			TLS:         &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12},
			TokenSource: client.StaticTokenSource(c.token),
			Audiences:   []string{"after-the-burst"},
		})
		require.NoError(t, err)
		defer gc.Close()
		began := time.Now()
		parallel(t, names[:60], 16, func(name string) error {
			_, err := gc.RESTConfigFor(ctx, namespace, name)
			return err
		})
		minted, _, refused := audit.take()
		t.Logf("60 new tokens beyond the limit in %s; refused and waited: %v", time.Since(began).Round(time.Millisecond), refused)
		assert.Equal(t, 60, minted)
		assert.Positive(t, refused[codes.ResourceExhausted.String()], "the client was never told to wait")
	})

	if ended := audit.streamsEnded(); len(ended) > 0 {
		t.Logf("agent streams that ended while the fleet was up, by why: %v", ended)
	}
	assert.Regexp(t, `^mints \d+$`, stopAgents())
}

// parallel runs fn for every item with at most workers at a time, and fails
// t with the errors.
func parallel(t *testing.T, items []string, workers int, fn func(string) error) {
	t.Helper()
	var failed atomic.Int32
	var first error
	var once sync.Once
	sem := make(chan struct{}, workers)
	var wg sync.WaitGroup
	for _, it := range items {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			if err := fn(it); err != nil {
				failed.Add(1)
				once.Do(func() { first = fmt.Errorf("%s: %w", it, err) })
			}
		})
	}
	wg.Wait()
	require.Zero(t, failed.Load(), "%d of %d failed; first: %v", failed.Load(), len(items), first)
}
