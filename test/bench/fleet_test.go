package bench

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/credbroker/credbroker/pkg/store"
	"github.com/credbroker/credbroker/test/framework"
)

// spokeLoad is scenario d: 50 consumers × 20 clusters, each consumer
// fetching every cluster's token every 30 s for 10 minutes.
func (b *bench) spokeLoad(t *testing.T) {
	ctx := t.Context()
	const consumers, clusters, period, span = 50, 20, 30 * time.Second, 10 * time.Minute
	rounds := int(span / period)
	// The clusters: ClusterProfiles that all point at the one spoke, each
	// served by an agent process of its own.
	names := make([]string, clusters)
	for i := range names {
		names[i] = fmt.Sprintf("load-%d", i+1)
		_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, names[i], deployment.ProfileAccess(spoke, framework.FleetNamespace, names[i]))
		require.NoError(t, err)
	}
	started := time.Now()
	procs := make([]*framework.Process, clusters)
	for i, name := range names {
		procs[i] = b.runAgent(t, name)
	}
	// Stopped when the scenario ends: twenty agents watching the spoke's
	// Secrets would slow the scenarios after it.
	defer func() {
		for _, p := range procs {
			p.Stop()
		}
	}()
	for i, name := range names {
		b.waitServes(t, name, procs[i])
	}
	t.Logf("%d agent processes serve after %s", clusters, time.Since(started).Round(time.Millisecond))

	before, err := spokeTokenRequests(ctx)
	require.NoError(t, err)
	var failed atomic.Int64
	var lifetime atomic.Int64
	var firstErr atomic.Value
	began := time.Now()
	for range rounds {
		var wg sync.WaitGroup
		for w := range consumers {
			wg.Go(func() {
				callCtx := bearer(ctx, b.consumers[w].Token)
				for _, name := range names {
					resp, err := b.clients[w].Exchange(callCtx, exchangeRequest(name))
					if err != nil {
						failed.Add(1)
						firstErr.CompareAndSwap(nil, err.Error())
						continue
					}
					lifetime.Store(int64(time.Until(resp.GetExpirationTime().AsTime())))
				}
			})
		}
		wg.Wait()
	}
	took := time.Since(began)
	after, err := spokeTokenRequests(ctx)
	require.NoError(t, err)
	if failed.Load() > 0 {
		// The broker's log names the check an answer failed.
		for line := range strings.SplitSeq(b.broker.Output(), "\n") {
			if strings.Contains(line, "failed the broker's checks") || strings.Contains(line, "level=ERROR") || strings.Contains(line, "E1130") {
				t.Log("broker: ", line)
			}
		}
	}
	require.Zero(t, failed.Load(), "failed exchanges; the first: %v", firstErr.Load())

	// The same fetches against the broker's rule, in-process on a fake
	// clock: a token is served until half its lifetime has passed.
	simulated := simulateHalfLife(t, consumers*clusters, rounds, period, time.Duration(lifetime.Load()))

	every := float64(consumers * clusters * rounds)
	got := after - before
	cut := 1 - got/every
	addRow(row{"d. spoke load: 50 consumers × 20 clusters, re-fetch every 30 s, 10 min", "spoke TokenRequests",
		fmt.Sprintf("%.0f (half-life rule on a fake clock: %d)", got, simulated), fmt.Sprintf("%.0f if every fetch minted", every),
		fmt.Sprintf("cut %.1f%%", 100*cut), "cut ≥ 95%", verdict(cut >= 0.95)})
	addNote("d: 20 ClusterProfiles that all point at the one spoke, each with its own spoke-agent process. The broker process runs on the real clock, "+
		"so the %d rounds (one every 30 s of the 10 simulated minutes) ran back to back, in %s; the broker's token cache serves a token until half its "+
		"lifetime (store.Halfway), and the tokens lived %s, so rounds 30 s apart would have minted the same. The count beside it replays the same "+
		"fetches through a pkg/store cache on a fake clock stepped 30 s per round (in-process): the count if each minted token lives as long. "+
		"Hub reviews are not counted here: the decision caches (10 s) would cost one TokenReview per consumer and one SubjectAccessReview per "+
		"consumer and cluster every 10 s on the hub, never the spoke.", rounds, took.Round(time.Millisecond), time.Duration(lifetime.Load()).Round(time.Minute))
}

// simulateHalfLife counts the mints of keys fetched once per period for
// rounds, by a pkg/store cache on a fake clock, for tokens living lifetime.
func simulateHalfLife(t *testing.T, keys, rounds int, period, lifetime time.Duration) int {
	clk := clocktesting.NewFakePassiveClock(time.Now())
	cache, err := store.New[string, int](store.Config{Size: keys + 1, MaxTTL: 24 * time.Hour, Clock: clk})
	require.NoError(t, err)
	mints := 0
	for range rounds {
		for k := range keys {
			_, _, err := cache.Do(context.Background(), fmt.Sprint(k), func(context.Context) (int, time.Time, error) {
				mints++
				now := clk.Now()
				return 0, store.Halfway(now, now.Add(lifetime)), nil
			})
			require.NoError(t, err)
		}
		clk.SetTime(clk.Now().Add(period))
	}
	return mints
}

// agentQPS is scenario e: sequential cold exchanges through the agent
// binary with client-go's default client rate (QPS 5, burst 10), beside
// the agent's defaults, in the same run.
func (b *bench) agentQPS(t *testing.T) {
	const n = 25
	run := func(args ...string) []time.Duration {
		b.agent.Stop()
		b.agent = b.startAgent(t, spoke.Name, args...)
		calls, err := sequential(n, func(int) ([]time.Duration, error) {
			start := time.Now()
			_, err := b.clients[0].Exchange(bearer(t.Context(), b.consumers[0].Token), exchangeRequest(spoke.Name, b.coldAudience(t)))
			return []time.Duration{time.Since(start)}, err
		})
		require.NoError(t, err)
		return column(calls, 0)
	}
	slow := run("--spoke-qps=5", "--spoke-burst=10")
	fast := run()
	addRow(row{"e. sequential cold exchanges, agent at client-go's QPS 5 / burst 10", "p50 / p99",
		ms(quantile(slow, 0.5)) + " / " + ms(quantile(slow, 0.99)),
		"agent defaults (--spoke-qps=50 --spoke-burst=100) " + ms(quantile(fast, 0.5)) + " / " + ms(quantile(fast, 0.99)),
		fmt.Sprintf("%.1f× slower at p50", float64(quantile(slow, 0.5))/float64(quantile(fast, 0.5))),
		"catches the 5-QPS trap", verdict(quantile(slow, 0.5) > 2*quantile(fast, 0.5))})
	addNote("e: %d sequential cold exchanges (decisions cached) through the spoke-agent binary, once with --spoke-qps=5 --spoke-burst=10 "+
		"(client-go's defaults, which the agent used before it had the flags) and once with its defaults; each mint is three spoke requests.", n)
}

// profile takes CPU, allocation and mutex profiles of the broker process
// under scenario a's load at 64 consumers, into $CREDBROKER_BENCH_OUT (or
// the work directory), and logs their tops.
func (b *bench) profile(t *testing.T) {
	ctx := t.Context()
	out := benchOut()
	req := exchangeRequest(spoke.Name, "cached")
	fetch := func(path, file string) {
		hreq, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+b.broker.metrics+path, nil)
		require.NoError(t, err)
		resp, err := http.DefaultClient.Do(hreq)
		require.NoError(t, err)
		defer resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, path)
		f, err := os.Create(filepath.Join(out, file))
		require.NoError(t, err)
		defer f.Close()
		_, err = io.Copy(f, resp.Body)
		require.NoError(t, err)
	}
	fetch("/debug/pprof/allocs", "allocs-before.pb.gz")
	var wg sync.WaitGroup
	wg.Go(func() { fetch("/debug/pprof/profile?seconds=6", "cpu.pb.gz") })
	r := load(ctx, maxConsumers, time.Second/2, 6*time.Second, func(ctx context.Context, w int) error {
		_, err := b.clients[w].Exchange(bearer(ctx, b.consumers[w].Token), req)
		return err
	})
	wg.Wait()
	require.NoError(t, r.err)
	fetch("/debug/pprof/allocs", "allocs-after.pb.gz")
	fetch("/debug/pprof/mutex", "mutex.pb.gz")
	t.Logf("profiled %.0f cached exchanges/s at 64 consumers; profiles in %s", r.rps(), out)
	for _, args := range [][]string{
		{"-top", "-nodecount=25", filepath.Join(out, "cpu.pb.gz")},
		{"-top", "-cum", "-nodecount=40", filepath.Join(out, "cpu.pb.gz")},
		{"-top", "-nodecount=25", "-sample_index=alloc_space", "-diff_base", filepath.Join(out, "allocs-before.pb.gz"), filepath.Join(out, "allocs-after.pb.gz")},
	} {
		cmd := exec.CommandContext(ctx, "go", append([]string{"tool", "pprof"}, append(args[:len(args)-1:len(args)-1], brokerBin, args[len(args)-1])...)...)
		text, err := cmd.CombinedOutput()
		require.NoError(t, err, string(text))
		t.Logf("go tool pprof %s:\n%s", strings.Join(args, " "), text)
		require.NoError(t, os.WriteFile(filepath.Join(out, strings.TrimPrefix(args[0], "-")+fmt.Sprint(len(args))+".txt"), text, 0o644))
	}
}
