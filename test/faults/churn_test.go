package faults

import (
	"context"
	"fmt"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// Tolerances of TestChurn between its first and its last round, measured
// with no load running: a leak of one goroutine per exchange, or of a
// fraction of the exchanges' memory, is far above them.
const (
	churnGoroutineSlack = 10
	churnHeapSlack      = 4 << 20 // bytes, on top of a quarter of the first round's heap goal
	// churnFlipTimeout bounds how long a flip of the opt-in takes to reach
	// the exchanges: the promise that a revoke kills a token within 20 s.
	churnFlipTimeout = 20 * time.Second
	// churnCallsAfterDeletion is how many of the load's calls for a deleted
	// ClusterProfile each round sees refused.
	churnCallsAfterDeletion = 5
)

// TestChurn runs the shipped broker and spoke-agent binaries as processes
// under a load (cached, refused, toggled opt-in, and churned ClusterProfile
// exchanges) for CHURN_DURATION (default 60s; the two minutes with
// CHURN_DURATION=2m), in three rounds. Each round creates a ClusterProfile
// with an agent process of its own, restarts that agent (SIGTERM, then
// SIGKILL), annotates and un-annotates a spoke ServiceAccount, each flip
// as soon as the last one shows in an exchange's answer, and deletes the
// ClusterProfile. An exchange for the toggled ServiceAccount is answered OK
// or PermissionDenied, never anything else (a grant that the agent's
// policy worker revokes during a mint once made it NotFound). No exchange
// for a deleted ClusterProfile is answered once the broker's informer has
// seen the deletion (its credbroker_cluster_profiles gauge drops), and
// neither the broker's nor the long-lived agent's goroutines or live heap
// (their own /metrics: go_goroutines, go_memstats_next_gc_bytes) grow from
// the first round to the last beyond a small slack.
func TestChurn(t *testing.T) {
	ctx := t.Context()
	total := durationFromEnv(t, "CHURN_DURATION", time.Minute)
	f := startProcFleet(t)
	c := newCaller(t, 1, spoke1, spoke2)
	c.client = f.client
	stranger, err := env.NewConsumer(ctx, c.Namespace, "stranger", "credbroker")
	require.NoError(t, err)
	toggled, err := spoke1.CreateServiceAccount(ctx, c.targetNS, "toggled", nil)
	require.NoError(t, err)
	// profiles is the ClusterProfiles in the broker's cache without the
	// churned one.
	profiles := f.brokerMetric(t, "credbroker_cluster_profiles")
	require.Positive(t, profiles)

	var churned atomic.Pointer[string] // the churned ClusterProfile's name, while the load asks for it
	exchange := func(client pb.TokenExchangeClient, consumer framework.Consumer, cluster, sa string) func(ctx context.Context, i int) error {
		return func(ctx context.Context, _ int) error {
			_, err := client.Exchange(consumer.Context(ctx), &pb.ExchangeRequest{
				Cluster:        &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: cluster},
				ServiceAccount: &pb.ObjectReference{Namespace: c.targetNS, Name: sa},
			})
			return err
		}
	}
	// flipped waits until an exchange for the toggled ServiceAccount
	// answers want: OK once the agent has seen the opt-in, PermissionDenied
	// once it has seen the opt-in go and the broker no longer hands out the
	// token whose grant the agent revoked. Any other answer fails at once.
	// It returns how long that took.
	flipped := func(want codes.Code) time.Duration {
		t.Helper()
		return waitFor(t, churnFlipTimeout, "an exchange for the toggled ServiceAccount to answer "+want.String(), func(ct assert.TestingT) {
			ctx, cancel := context.WithTimeout(ctx, mintTimeout)
			defer cancel()
			err := exchange(f.client, c.Consumer, spoke1.Name, "toggled")(ctx, 0)
			code := status.Code(err)
			require.Contains(t, []codes.Code{codes.OK, codes.PermissionDenied}, code, "an exchange for the toggled ServiceAccount: %v", err)
			assert.Equal(ct, want, code, "an exchange for the toggled ServiceAccount: %v", err)
		}, f.broker, f.agent)
	}
	_, _, err = c.exchange(spoke1, 0, mintTimeout)
	require.NoError(t, err)
	load := startLoad(
		loop{kind: "cached", do: exchange(f.client, c.Consumer, spoke1.Name, "target-0")},
		loop{kind: "refused", do: exchange(f.client, stranger, spoke1.Name, "target-0")},
		loop{kind: "toggled", do: exchange(f.client, c.Consumer, spoke1.Name, "toggled")},
		loop{kind: "churned", record: true, do: func(ctx context.Context, i int) error {
			name := churned.Load()
			if name == nil {
				time.Sleep(50 * time.Millisecond)
				return errNoCall
			}
			return exchange(f.client, c.Consumer, *name, "target-0")(ctx, i)
		}},
	)
	defer load.end()

	var rounds [3]struct{ broker, agent usage }
	start := time.Now()
	for r := range rounds {
		roundEnd := start.Add(total * time.Duration(r+1) / time.Duration(len(rounds)))
		name := fmt.Sprintf("churn-%d-%d", seq.Add(1), r)
		_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, deployment.ProfileAccess(spoke2, framework.FleetNamespace, name))
		require.NoError(t, err)
		require.NoError(t, env.Hub.GrantClusterProfileToken(ctx, framework.FleetNamespace, name, c.Namespace, c.Name))
		agentOpts := framework.AgentProcessOptions{Bin: agentBin, BrokerAddresses: []string{f.brokerOpts.AgentAddress}, ClusterProfile: name}
		agent, err := deployment.StartAgentProcess(ctx, spoke2, agentOpts)
		require.NoError(t, err)
		serves := func(ct assert.TestingT) {
			callCtx, cancel := context.WithTimeout(ctx, 2*mintTimeout)
			defer cancel()
			assert.NoError(ct, exchange(f.client, c.Consumer, name, "target-0")(callCtx, 0), "an exchange for %s", name)
		}
		waitFor(t, time.Minute, "the churned ClusterProfile to be served", serves, f.broker, agent)
		churned.Store(&name)

		// Restart the churned agent halfway through the round; toggle the
		// opt-in until the round's end, each time as soon as the last flip
		// has taken effect.
		restarted := false
		toggles, slowestFlip := 0, time.Duration(0)
		for i := 0; time.Now().Before(roundEnd.Add(-3 * time.Second)); i++ {
			if !restarted && time.Now().After(roundEnd.Add(-total/time.Duration(2*len(rounds)))) {
				sig := syscall.SIGTERM
				if r%2 == 1 {
					sig = syscall.SIGKILL
				}
				require.NoError(t, agent.Signal(sig))
				_ = agent.Wait()
				agent, err = deployment.StartAgentProcess(ctx, spoke2, agentOpts)
				require.NoError(t, err)
				restarted = true
			}
			sa, err := spoke1.Client.CoreV1().ServiceAccounts(c.targetNS).Get(ctx, toggled.Name, metav1.GetOptions{})
			require.NoError(t, err)
			if i%2 == 0 {
				sa.Annotations = map[string]string{"credbroker.io/allowed-subjects": c.Username()}
			} else {
				sa.Annotations = nil
			}
			_, err = spoke1.Client.CoreV1().ServiceAccounts(c.targetNS).Update(ctx, sa, metav1.UpdateOptions{})
			require.NoError(t, err)
			want := codes.OK
			if i%2 == 1 {
				want = codes.PermissionDenied
			}
			slowestFlip = max(slowestFlip, flipped(want))
			toggles++
		}
		waitFor(t, time.Minute, "the restarted churned agent to serve", serves, f.broker, agent)

		// Delete the ClusterProfile while the load asks for it.
		require.NoError(t, env.Hub.Inventory.ApisV1alpha1().ClusterProfiles(framework.FleetNamespace).Delete(ctx, name, metav1.DeleteOptions{}))
		deleted := time.Now()
		waitFor(t, time.Minute, "the broker to see the deletion", func(ct assert.TestingT) {
			assert.Equal(ct, profiles, f.brokerMetric(t, "credbroker_cluster_profiles"), "the broker process's credbroker_cluster_profiles (-1: no scrape)")
		}, f.broker)
		seen := time.Now()
		// The load asks for the deleted ClusterProfile meanwhile: wait for a
		// few of its calls that started after the broker saw the deletion,
		// so that the check below is never vacuous.
		waitFor(t, time.Minute, "the load to ask for the deleted ClusterProfile", func(ct assert.TestingT) {
			load.mu.Lock()
			defer load.mu.Unlock()
			n := 0
			for _, call := range load.calls {
				if call.kind == "churned" && call.start.After(seen) {
					n++
				}
			}
			assert.GreaterOrEqual(ct, n, churnCallsAfterDeletion, "calls for %s since the broker saw its deletion", name)
		})
		code, _, err := (&caller{Consumer: c.Consumer, client: f.client, targetNS: c.targetNS, targets: map[string][]string{name: {"target-0"}}}).
			exchange(&framework.Cluster{Name: name}, 0, mintTimeout)
		require.Equal(t, codes.NotFound, code, "%v", err)
		churned.Store(nil)
		require.NoError(t, agent.Signal(syscall.SIGTERM))
		_ = agent.Wait()

		load.pause()
		answered, after := 0, 0
		load.mu.Lock()
		for _, call := range load.calls {
			if call.kind == "churned" && call.start.After(seen) {
				after++
				if call.code == codes.OK {
					answered++
				}
			}
		}
		load.calls = nil
		load.mu.Unlock()
		require.Zero(t, answered, "exchanges for %s answered after the broker saw its deletion", name)
		waitFor(t, mintTimeout+5*time.Second, "no pending agent requests on the broker process", func(ct assert.TestingT) {
			assert.Zero(ct, f.brokerMetric(t, "credbroker_agent_requests_pending"), "the broker process's credbroker_agent_requests_pending (-1: no scrape)")
		}, f.broker)
		rounds[r].broker = settledUsage(t, f.brokerOpts.MetricsAddress)
		rounds[r].agent = settledUsage(t, f.agentMetrics)
		t.Logf("churn round %d (%s): %d opt-in flips, each seen by the agent and the broker within %s; deletion seen %s after it, then %d calls for it, none answered; broker %s; agent %s",
			r+1, name, toggles, slowestFlip.Round(10*time.Millisecond), seen.Sub(deleted).Round(10*time.Millisecond), after, rounds[r].broker, rounds[r].agent)
		load.resume()
	}
	load.pause()
	t.Logf("churn for %s: %s", time.Since(start).Round(time.Second), load.summary())
	first, last := rounds[0], rounds[len(rounds)-1]
	for _, p := range []struct {
		name        string
		first, last usage
	}{{"broker", first.broker, last.broker}, {"agent", first.agent, last.agent}} {
		require.LessOrEqual(t, p.last.Goroutines, p.first.Goroutines+churnGoroutineSlack,
			"the %s's goroutines grew from round 1 to round 3: a leak", p.name)
		require.LessOrEqual(t, p.last.HeapGoal, p.first.HeapGoal*1.25+churnHeapSlack,
			"the %s's live heap grew from round 1 to round 3: a leak", p.name)
	}
	load.mu.Lock()
	defer load.mu.Unlock()
	for kind, want := range map[string][]codes.Code{
		"cached":  {codes.OK},
		"refused": {codes.PermissionDenied},
		"toggled": {codes.OK, codes.PermissionDenied},
	} {
		require.NotEmpty(t, load.codes[kind], "no %s exchange ran", kind)
		for code := range load.codes[kind] {
			require.Contains(t, want, code, "a %s exchange", kind)
		}
	}
}
