package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	rbacv1 "k8s.io/api/rbac/v1"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

const (
	// fleetProfiles ClusterProfiles, of which fleetStreams have an agent
	// stream, in fleetNS.
	fleetProfiles, fleetStreams = 10000, 10000
	fleetNS                     = "fleet-scale"
	// fleetConsumers each cache tokensPerConsumer tokens, of as many
	// clusters: fleetConsumers × tokensPerConsumer cached tokens.
	fleetConsumers, tokensPerConsumer = 64, 125
	// memLimit is the broker's GOMEMLIMIT, under the 1 GiB the scenario
	// must fit in.
	memLimit = "900MiB"
)

// memSample is what the broker's /metrics said, right after a garbage
// collection that the test asked for.
type memSample struct {
	rss, heap, goroutines, streams float64
}

// TestBenchFleet is scenario f, which `make bench-fleet` runs apart from
// `make bench` (it takes longer than the rest together): one broker process
// with 10,000 ClusterProfiles and 10,000 agent streams (test/fleetagents, one
// process, each agent with its own SVID over real mTLS), its memory and
// goroutines at each step, cached exchanges under that load, and the time
// the 10,000 agents take to come back after the broker is killed and
// started again on the same ports.
func TestBenchFleet(t *testing.T) {
	began := time.Now()
	ctx := t.Context()

	agentsBin := filepath.Join(workDir, "fleetagents")
	require.NoError(t, framework.Build(ctx, workDir, framework.Module+"/test/fleetagents"))

	// The broker, on ports it keeps across its restart.
	var bp brokerProc
	var err error
	for _, p := range []*string{&bp.exchange, &bp.agent, &bp.metrics} {
		*p, err = framework.FreeAddr()
		require.NoError(t, err)
	}
	args := append([]string{"--profiling", "--audit-log-path=" + workDir + "/audit-fleet.log"}, consumerLimits...)
	start := func() {
		bp.Process, err = deployment.StartBrokerProcess(framework.BrokerProcessOptions{
			Bin: brokerBin, ExchangeAddress: bp.exchange, AgentAddress: bp.agent, MetricsAddress: bp.metrics, Args: args,
			// As deploy/hub sets it from the container's memory limit.
			Env: []string{"GOMEMLIMIT=" + memLimit},
		})
		require.NoError(t, err)
	}
	start()
	t.Cleanup(func() {
		bp.Stop()
		// Its log, for when a step fails.
		_ = os.WriteFile(filepath.Join(benchOut(), "fleet-broker.log"), []byte(bp.Output()), 0o644)
	})
	waitReady(t, bp)
	s0 := sample(t, bp, "fleet-heap-0.pb.gz")

	// Consumers, allowed every ClusterProfile of the namespace.
	const consumerNS = "bench-fleet"
	require.NoError(t, env.Hub.Grant(ctx, fleetNS, rbacv1.Subject{Kind: rbacv1.GroupKind, Name: "system:serviceaccounts:" + consumerNS},
		[]rbacv1.PolicyRule{framework.ClusterProfileTokenRule()}))
	consumers := make([]framework.Consumer, fleetConsumers)
	clients := make([]pb.TokenExchangeClient, fleetConsumers)
	for i := range consumers {
		c := framework.Consumer{Namespace: consumerNS, Name: fmt.Sprintf("consumer-%d", i)}
		_, err := env.Hub.CreateServiceAccount(ctx, c.Namespace, c.Name, nil)
		require.NoError(t, err)
		c.Token, err = env.Hub.Token(ctx, c.Namespace, c.Name, []string{"credbroker"}, time.Hour)
		require.NoError(t, err)
		consumers[i] = c
		client, conn, err := deployment.ExchangeClient(bp.exchange)
		require.NoError(t, err)
		t.Cleanup(func() { conn.Close() })
		clients[i] = client
	}

	// The ClusterProfiles, created in parallel with the admin client.
	names := make([]string, fleetProfiles)
	for i := range names {
		names[i] = fmt.Sprintf("cluster-%04d", i)
	}
	created := time.Now()
	access := deployment.ClusterProfileAccess(spoke)
	parallel(t, names, 32, func(name string) error {
		_, err := env.Hub.CreateClusterProfile(ctx, fleetNS, name, access)
		return err
	})
	took := time.Since(created)
	// The broker knows the last one once an exchange for it is refused as
	// Unavailable (no agent) rather than NotFound.
	last := exchangeRequestIn(names[fleetProfiles-1])
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		_, err := clients[0].Exchange(bearer(ctx, consumers[0].Token), last)
		assert.Equal(c, codes.Unavailable, status.Code(err), "an exchange for the last ClusterProfile: %v", err)
	}, 2*time.Minute, 200*time.Millisecond, "the broker did not learn the ClusterProfiles")
	s1 := sample(t, bp, "fleet-heap-1.pb.gz")
	t.Logf("%d ClusterProfiles created in %s", fleetProfiles, took.Round(time.Millisecond))

	// The agents, each with its own SVID.
	svids := filepath.Join(workDir, "svids")
	require.NoError(t, os.MkdirAll(svids, 0o700))
	for _, name := range names[:fleetStreams] {
		certPEM, keyPEM, err := deployment.CA.IssueSVID("spiffe://"+framework.TrustDomain+"/clusterprofile/"+fleetNS+"/"+name, 2*time.Hour)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(svids, name+".crt"), certPEM, 0o600))
		require.NoError(t, os.WriteFile(filepath.Join(svids, name+".key"), keyPEM, 0o600))
	}
	agents := exec.Command(agentsBin, "--broker-address="+bp.agent, "--svid-dir="+svids,
		"--trust-bundle-file="+deployment.CAFile, "--trust-domain="+framework.TrustDomain, "--admit-timeout=5m")
	stdin, err := agents.StdinPipe()
	require.NoError(t, err)
	stdout, err := agents.StdoutPipe()
	require.NoError(t, err)
	var agentErr strings.Builder
	agents.Stderr = &agentErr
	require.NoError(t, agents.Start())
	t.Cleanup(func() {
		_ = stdin.Close()
		_, _ = io.Copy(io.Discard, stdout)
		_ = agents.Wait()
	})
	lines := bufio.NewScanner(stdout)
	admitStart := time.Now()
	admitProfile := cpuProfile(t, bp, 10*time.Second, "fleet-admit-cpu.pb.gz")
	require.True(t, lines.Scan(), "the simulated agents stopped before they were admitted: %s", agentErr.String())
	require.Equal(t, fmt.Sprintf("admitted %d", fleetStreams), lines.Text())
	admitTook := time.Since(admitStart)
	admitProfile()
	s2 := sample(t, bp, "fleet-heap-2.pb.gz")
	require.Equal(t, float64(fleetStreams), s2.streams)

	// Cached tokens: consumer i asks for tokensPerConsumer clusters of its
	// own slice of the streams.
	clusterOf := func(i, j int) string { return names[(i*tokensPerConsumer+j)%fleetStreams] }
	type job struct{ i, j int }
	var jobs []job
	for i := range fleetConsumers {
		for j := range tokensPerConsumer {
			jobs = append(jobs, job{i, j})
		}
	}
	cacheStart := time.Now()
	parallelJobs(t, len(jobs), 64, func(k int) error {
		i, j := jobs[k].i, jobs[k].j
		_, err := clients[i].Exchange(bearer(ctx, consumers[i].Token), exchangeRequestIn(clusterOf(i, j)))
		return err
	})
	cacheTook := time.Since(cacheStart)
	s3 := sample(t, bp, "fleet-heap-3.pb.gz")
	tokens := float64(len(jobs))

	// Cached exchanges under that load, beside the echo at the same
	// concurrency; each worker cycles through its consumer's clusters.
	callCtx := make([]context.Context, fleetConsumers)
	for i := range callCtx {
		callCtx[i] = bearer(ctx, consumers[i].Token)
	}
	reqs := make([][]*pb.ExchangeRequest, fleetConsumers)
	for i := range reqs {
		for j := range tokensPerConsumer {
			reqs[i] = append(reqs[i], exchangeRequestIn(clusterOf(i, j)))
		}
	}
	resp, err := clients[0].Exchange(callCtx[0], reqs[0][0])
	require.NoError(t, err)
	echoProc, echoConns, err := startEcho(ctx, proto.Size(resp), fleetConsumers)
	require.NoError(t, err)
	defer echoProc.Stop()
	warmup, measure := 500*time.Millisecond, 3*time.Second
	// rollFor is longer than --authz-allow-ttl (10 s). Keeping rollKeys
	// decisions of each consumer fresh takes fleetConsumers × rollKeys
	// SubjectAccessReviews per 7.5 s on the hub.
	const rollFor, rollKeys = 12 * time.Second, 16
	metric := func(name string, labels ...string) float64 {
		n, err := brokerMetric(ctx, bp.metrics, name, labels...)
		require.NoError(t, err)
		return n
	}
	// cycle loads the broker for measure with every worker cycling through
	// the first keys of its consumer's clusters, and counts the
	// SubjectAccessReview cache's misses (the reviews that calls waited
	// for) and the hub's SubjectAccessReviews (those and the refreshes)
	// meanwhile.
	type reviews struct{ missed, hub float64 }
	countReviews := func() reviews {
		return reviews{metric("credbroker_decision_cache_lookups_total", `cache="authz"`, `result="miss"`),
			metric("credbroker_hub_review_duration_seconds", `kind="SubjectAccessReview"`)}
	}
	cycle := func(keys int, measure time.Duration) (loadResult, reviews) {
		next := make([]int, fleetConsumers)
		before := countReviews()
		r := load(ctx, fleetConsumers, warmup, measure, func(ctx context.Context, w int) error {
			next[w] = (next[w] + 1) % keys
			_, err := clients[w].Exchange(callCtx[w], reqs[w][next[w]])
			return err
		})
		require.NoError(t, r.err)
		after := countReviews()
		return r, reviews{after.missed - before.missed, after.hub - before.hub}
	}
	// Fresh decisions: 8 clusters per consumer, each reviewed again just
	// before, so every call is answered from the caches.
	const fresh = 8
	parallelJobs(t, fleetConsumers*fresh, 64, func(k int) error {
		_, err := clients[k/fresh].Exchange(callCtx[k/fresh], reqs[k/fresh][k%fresh])
		return err
	})
	freshProfile := cpuProfile(t, bp, 3*time.Second, "fleet-cached-cpu.pb.gz")
	exFresh, revFresh := cycle(fresh, measure)
	freshProfile()
	// All of its clusters, whose decisions (made when the tokens were
	// cached, more than 10 s ago) are reviewed again as they come round
	// (--authz-allow-ttl, 10 s).
	exAll, revAll := cycle(tokensPerConsumer, measure)
	// Then rollKeys clusters each, kept up for longer than
	// --authz-allow-ttl: every decision comes to its end during the
	// measure, and is refreshed ahead of it, since it was used. Each is
	// made, then used, first.
	for range 2 {
		parallelJobs(t, fleetConsumers*rollKeys, 64, func(k int) error {
			_, err := clients[k/rollKeys].Exchange(callCtx[k/rollKeys], reqs[k/rollKeys][k%rollKeys])
			return err
		})
	}
	exRoll, revRoll := cycle(rollKeys, rollFor)
	ec := load(ctx, fleetConsumers, warmup, measure, func(ctx context.Context, w int) error { return echo(ctx, echoConns[w]) })
	require.NoError(t, ec.err)
	s4 := sample(t, bp, "fleet-heap-4.pb.gz")

	// The broker killed (SIGKILL) and started again on the same ports: how
	// long until every agent stream is back.
	require.NoError(t, bp.Signal(syscall.SIGKILL))
	_ = bp.Wait()
	killed := time.Now()
	start()
	waitReady(t, bp)
	ready := time.Since(killed)
	deadline := time.Now().Add(5 * time.Minute)
	var back time.Duration
	for logged := time.Now(); ; {
		n, err := brokerMetric(ctx, bp.metrics, "credbroker_agent_streams")
		if err == nil && n == fleetStreams {
			back = time.Since(killed)
			break
		}
		if time.Since(logged) >= 2*time.Second {
			t.Logf("%.0f agent streams %s after the kill", n, time.Since(killed).Round(time.Second))
			logged = time.Now()
		}
		require.True(t, time.Now().Before(deadline), "%v streams of %d after 5 minutes (%v)", n, fleetStreams, err)
		time.Sleep(100 * time.Millisecond)
	}
	s5 := sample(t, bp, "fleet-heap-5.pb.gz")

	mib := func(b float64) string { return fmt.Sprintf("%.0f MiB", b/(1<<20)) }
	kib := func(b float64) string { return fmt.Sprintf("%.1f KiB", b/(1<<10)) }
	scen := fmt.Sprintf("f. fleet: %s ClusterProfiles, %s agent streams", thousands(fleetProfiles), thousands(fleetStreams))
	addRow(row{scen, "RSS / Go heap in use / goroutines, idle broker", fmt.Sprintf("%s / %s / %.0f", mib(s0.rss), mib(s0.heap), s0.goroutines), "", "", "", ""})
	addRow(row{scen, fmt.Sprintf("… with %s ClusterProfiles", thousands(fleetProfiles)), fmt.Sprintf("%s / %s / %.0f", mib(s1.rss), mib(s1.heap), s1.goroutines), "idle broker",
		fmt.Sprintf("%s heap per ClusterProfile", kib((s1.heap-s0.heap)/fleetProfiles)), "", ""})
	addRow(row{scen, fmt.Sprintf("… and %s agent streams", thousands(fleetStreams)), fmt.Sprintf("%s / %s / %.0f", mib(s2.rss), mib(s2.heap), s2.goroutines),
		fmt.Sprintf("%s ClusterProfiles, no stream", thousands(fleetProfiles)),
		fmt.Sprintf("per stream: %s RSS, %s heap, %.1f goroutines", kib((s2.rss-s1.rss)/fleetStreams), kib((s2.heap-s1.heap)/fleetStreams), (s2.goroutines-s1.goroutines)/fleetStreams), "", ""})
	addRow(row{scen, fmt.Sprintf("… and %.0f cached tokens", tokens), fmt.Sprintf("%s / %s / %.0f", mib(s3.rss), mib(s3.heap), s3.goroutines), fmt.Sprintf("%s streams, no token", thousands(fleetStreams)),
		fmt.Sprintf("per cached token: %s RSS, %s heap", kib((s3.rss-s2.rss)/tokens), kib((s3.heap-s2.heap)/tokens)),
		"≤ 1 GiB RSS", verdict(max(s3.rss, s4.rss) <= 1<<30)})
	addRow(row{scen, fmt.Sprintf("cached exchange at %d consumers, %d clusters each, decisions fresh: throughput, p50 / p99 / p99.9", fleetConsumers, fresh),
		fmt.Sprintf("%.0f/s, %s (%.0f SubjectAccessReviews)", exFresh.rps(), lat3(exFresh), revFresh.missed), fmt.Sprintf("echo %.0f/s, %s", ec.rps(), lat3(ec)),
		fmt.Sprintf("%.2f of echo; p99 %.1f× echo", exFresh.rps()/ec.rps(), float64(exFresh.q(0.99))/float64(ec.q(0.99))),
		"p99 ≤ 2× echo", verdict(exFresh.q(0.99) <= 2*ec.q(0.99))})
	addRow(row{scen, fmt.Sprintf("… all %d clusters each, decisions older than --authz-allow-ttl (10 s)", tokensPerConsumer),
		fmt.Sprintf("%.0f/s, %s (%.0f SubjectAccessReviews)", exAll.rps(), lat3(exAll), revAll.missed), fmt.Sprintf("echo %.0f/s, %s", ec.rps(), lat3(ec)),
		fmt.Sprintf("%.2f of echo; p99 %.1f× echo", exAll.rps()/ec.rps(), float64(exAll.q(0.99))/float64(ec.q(0.99))), "", ""})
	addRow(row{scen, fmt.Sprintf("… %d clusters each, kept up for %s, so that every decision rolls over", rollKeys, rollFor),
		fmt.Sprintf("%.0f/s, %s (%.0f SubjectAccessReviews waited for; %.0f on the hub)", exRoll.rps(), lat3(exRoll), revRoll.missed, revRoll.hub),
		fmt.Sprintf("fresh decisions: p99 %s", ms(exFresh.q(0.99))),
		fmt.Sprintf("p99 %.2f× fresh decisions'", float64(exRoll.q(0.99))/float64(exFresh.q(0.99))),
		"p99 ≤ 1.5× fresh decisions'", verdict(exRoll.q(0.99) <= exFresh.q(0.99)*3/2)})
	addRow(row{scen, fmt.Sprintf("%s agents back after the broker is killed (SIGKILL) and restarted", thousands(fleetStreams)),
		fmt.Sprintf("%s (broker ready after %s)", back.Round(time.Millisecond), ready.Round(time.Millisecond)),
		fmt.Sprintf("first admission of the %s: %s", thousands(fleetStreams), admitTook.Round(time.Millisecond)), "", "≤ 30 s", verdict(back <= 30*time.Second)})
	addNote("f: `make bench-fleet`, apart from `make bench`. One broker process (default flags but the raised consumer limits of a, --profiling, "+
		"--audit-log-mode=blocking); %d ClusterProfiles created in %s by 32 parallel admin clients; %d agents simulated by test/fleetagents in one "+
		"process, each with its own SVID and mTLS connection, answering mints with made-up tokens (no spoke API server: the broker is under test). "+
		"Memory is the broker's process_resident_memory_bytes and go_memstats_heap_inuse_bytes, each read right after a garbage collection "+
		"(/debug/pprof/heap?gc=1), so heap figures are live data; RSS also holds freed memory the Go runtime has not returned. "+
		"Cached tokens: %d consumers × %d clusters each, minted in %s by 64 workers; each also holds its SubjectAccessReview decision. "+
		"After the exchange load: %s RSS, %.0f goroutines. "+
		"Restart: SIGKILL, then the same binary and ports at once; the agents reconnect as pkg/tunnel's client does (a new connection after a "+
		"wait jittered in [b/2, b], b from 500ms doubling to 30s, reset by an admission), so the time is the broker's start plus the agents' "+
		"backoff; counted by the broker's credbroker_agent_streams. After the restart: %s RSS, %.0f goroutines.",
		fleetProfiles, took.Round(time.Second), fleetStreams, fleetConsumers, tokensPerConsumer, cacheTook.Round(time.Millisecond),
		mib(s4.rss), s4.goroutines, mib(s5.rss), s5.goroutines)

	text := render("make bench-fleet", "-run TestBenchFleet", time.Since(began))
	fmt.Println("\n" + text)
	if path := os.Getenv("CREDBROKER_BENCH_DOC"); path != "" {
		require.NoError(t, writeDocBetween(path, text, fleetBeginMarker, fleetEndMarker))
		t.Logf("wrote the table to %s", path)
	}
}

// benchOut is where profiles go: CREDBROKER_BENCH_OUT, or the work folder.
func benchOut() string {
	if out := os.Getenv("CREDBROKER_BENCH_OUT"); out != "" {
		_ = os.MkdirAll(out, 0o755)
		return out
	}
	return workDir
}

// cpuProfile starts a CPU profile of the broker for d, written to file in
// benchOut; the returned func waits for it.
func cpuProfile(t *testing.T, bp brokerProc, d time.Duration, file string) (wait func()) {
	out := benchOut()
	done := make(chan error, 1)
	go func() {
		resp, err := http.Get(fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", bp.metrics, int(d.Seconds())))
		if err != nil {
			done <- err
			return
		}
		defer resp.Body.Close()
		f, err := os.Create(filepath.Join(out, file))
		if err != nil {
			done <- err
			return
		}
		_, err = io.Copy(f, resp.Body)
		done <- errors.Join(err, f.Close())
	}()
	return func() { require.NoError(t, <-done, file) }
}

// thousands writes n with a comma between each group of three digits.
func thousands(n int) string {
	s := strconv.Itoa(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

func exchangeRequestIn(cluster string) *pb.ExchangeRequest {
	return &pb.ExchangeRequest{
		Cluster:        &pb.ObjectReference{Namespace: fleetNS, Name: cluster},
		ServiceAccount: &pb.ObjectReference{Namespace: targetNS, Name: targetSA},
	}
}

// waitReady returns once the broker's /readyz answers 200.
func waitReady(t *testing.T, bp brokerProc) {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		resp, err := http.Get("http://" + bp.metrics + "/readyz")
		last := fmt.Sprint(err)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
			last = resp.Status
		}
		if time.Now().After(deadline) {
			t.Fatalf("the broker is not ready after 2 minutes (last /readyz: %s)\n%s", last, tail(bp.Output()))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// sample collects the broker's garbage, then reads its memory, goroutines
// and agent streams from /metrics.
func sample(t *testing.T, bp brokerProc, heapFile string) memSample {
	ctx := t.Context()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+bp.metrics+"/debug/pprof/heap?gc=1", nil)
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	heap, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(benchOut(), heapFile), heap, 0o644))
	var s memSample
	for _, m := range []struct {
		name string
		p    *float64
	}{
		{"process_resident_memory_bytes", &s.rss}, {"go_memstats_heap_inuse_bytes", &s.heap},
		{"go_goroutines", &s.goroutines}, {"credbroker_agent_streams", &s.streams},
	} {
		*m.p, err = brokerMetric(ctx, bp.metrics, m.name)
		require.NoError(t, err)
	}
	t.Logf("broker: RSS %.0f MiB, heap %.0f MiB, %.0f goroutines, %.0f agent streams", s.rss/(1<<20), s.heap/(1<<20), s.goroutines, s.streams)
	return s
}

// parallel calls fn for every item, workers at a time; all must succeed.
func parallel(t *testing.T, items []string, workers int, fn func(string) error) {
	t.Helper()
	parallelJobs(t, len(items), workers, func(k int) error { return fn(items[k]) })
}

// parallelJobs calls fn(0) to fn(n-1), workers at a time; all must succeed.
func parallelJobs(t *testing.T, n, workers int, fn func(int) error) {
	t.Helper()
	var next atomic.Int64
	var mu sync.Mutex
	var errs []error
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for {
				k := int(next.Add(1) - 1)
				if k >= n {
					return
				}
				if err := fn(k); err != nil {
					mu.Lock()
					errs = append(errs, fmt.Errorf("%d: %w", k, err))
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	require.NoError(t, errors.Join(errs[:min(len(errs), 3)]...), "%d of %d failed", len(errs), n)
}
