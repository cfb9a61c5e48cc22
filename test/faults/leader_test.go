package faults

import (
	"context"
	"fmt"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/credbroker/credbroker/pkg/broker"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// Two broker replicas, the shipped binary, and the agent of one
// ClusterProfile, also shipped, connected to both: every replica holds the
// fleet's live grants, and the revocation triggers' SubjectAccessReviews
// would be the same on each. With a Lease each, as every replica did before
// the triggers had one, a hub RBAC change costs each replica its reviews;
// with the one Lease they share, only its holder's reach the hub, counted
// by the replicas' own credbroker_hub_review_duration_seconds. Either way
// the RBAC change revokes. Then the holder is SIGKILLed, and a consumer
// loses its RBAC before the other replica can take the Lease over: that
// replica checks every live grant when it does, and revokes; a change after
// the takeover revokes too.
//
// The attack on the Lease: someone who may write Leases in the broker's
// namespace holds the triggers' Lease under a name of their own, and keeps
// renewing it. No replica runs the triggers (the sum of their
// credbroker_revocation_triggers_leader is 0, which an alert watches), and
// an RBAC change revokes nothing; once the intruder stops renewing, a
// replica takes the Lease over and its sweep revokes.
func TestRevocationTriggersLedByOneReplica(t *testing.T) {
	for _, tc := range []struct {
		name string
		mode leaseMode
	}{
		{"a Lease each, as every replica ran the triggers before", leaseEach},
		{"one Lease", leaseShared},
		{"one Lease that an intruder holds", leaseHeld},
	} {
		t.Run(tc.name, func(t *testing.T) { testTriggersLeader(t, tc.mode) })
	}
}

// leaseMode is how the replicas of testTriggersLeader campaign.
type leaseMode int

const (
	leaseEach   leaseMode = iota // a Lease of its own each
	leaseShared                  // one Lease
	leaseHeld                    // one Lease, which an intruder holds
)

// triggerConsumer is a consumer that holds a spoke token, and can lose
// its hub RBAC.
type triggerConsumer struct {
	framework.Consumer
	token string
}

func testTriggersLeader(t *testing.T, mode leaseMode) {
	ctx := t.Context()
	name := unique("leader")
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, deployment.ProfileAccess(spoke1, framework.FleetNamespace, name))
	require.NoError(t, err)
	t.Cleanup(func() { deleteClusterProfile(t, name) })
	lease := unique("triggers")
	var stopIntruder func()
	if mode == leaseHeld {
		stopIntruder = holdLease(t, lease)
	}
	replicas := make([]framework.BrokerProcessOptions, 2)
	procs := make([]*framework.Process, 2)
	var agentAddrs []string
	for i := range replicas {
		r := framework.BrokerProcessOptions{Bin: brokerBin, Args: []string{
			// The checks of an RBAC change come at once; no sweep but the
			// takeover's.
			"--rbac-debounce=200ms", "--rbac-debounce-max=500ms", "--grant-recheck-interval=1h",
			fmt.Sprintf("--publish-identity=replica-%d", i),
			"--audit-log-path=" + filepath.Join(t.TempDir(), "audit.log"),
		}}
		if mode != leaseEach {
			r.TriggerLeaseName = lease
		}
		for _, p := range []*string{&r.ExchangeAddress, &r.AgentAddress, &r.MetricsAddress} {
			*p, err = framework.FreeAddr()
			require.NoError(t, err)
		}
		replicas[i], agentAddrs = r, append(agentAddrs, r.AgentAddress)
		procs[i], err = deployment.StartBrokerProcess(r)
		require.NoError(t, err)
		t.Cleanup(procs[i].Stop)
	}
	// Ready first, so that the agent's first dial finds them serving,
	// rather than backing off towards 30 s on a loaded machine.
	for _, r := range replicas {
		waitFor(t, time.Minute, "both replicas to be ready", func(c assert.TestingT) { assertReady(c, r.MetricsAddress) }, procs...)
	}
	agent, err := deployment.StartAgentProcess(ctx, spoke1, framework.AgentProcessOptions{Bin: agentBin, ClusterProfile: name, BrokerAddresses: agentAddrs})
	require.NoError(t, err)
	t.Cleanup(agent.Stop)
	t.Cleanup(func() {
		if t.Failed() {
			for i, p := range procs {
				t.Logf("replica %d:\n%s", i, p.Output())
			}
			t.Logf("agent:\n%s", agent.Output())
		}
	})
	metric := func(i int, name string, labels ...string) float64 {
		m, err := framework.ScrapeMetrics(ctx, replicas[i].MetricsAddress)
		if err != nil {
			return -1
		}
		return m.Sum(name, labels...)
	}
	for i := range replicas {
		waitFor(t, 2*time.Minute, "the agent to connect to both replicas", func(c assert.TestingT) {
			assert.GreaterOrEqual(c, metric(i, "credbroker_connected_clusters"), 1.0, "replica %d's credbroker_connected_clusters (-1: no scrape)", i)
		}, procs[i], agent)
	}

	// Three consumers hold a spoke token each, through replica 0; both
	// replicas learn the grants from the agent.
	spokeNS := unique("leader-spoke")
	consumers := make([]triggerConsumer, 3)
	var usernames []string
	for i := range consumers {
		consumers[i].Consumer, err = env.NewConsumer(ctx, unique("leader-hub"), "consumer", "credbroker", name)
		require.NoError(t, err)
		usernames = append(usernames, consumers[i].Username())
	}
	require.NoError(t, spoke1.EnsureNamespace(ctx, spokeNS))
	require.NoError(t, deployment.OptIn(ctx, spoke1, spokeNS, "target", usernames...))
	clients := make([]*grpcClients, len(replicas))
	for i, r := range replicas {
		clients[i] = dialReplica(t, r.ExchangeAddress)
	}
	for i := range consumers {
		c := &consumers[i]
		cctx, cancel := context.WithTimeout(c.Context(ctx), 2*mintTimeout)
		resp, err := clients[0].exchange.Exchange(cctx, &pb.ExchangeRequest{
			Cluster:        &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: name},
			ServiceAccount: &pb.ObjectReference{Namespace: spokeNS, Name: "target"},
		})
		cancel()
		require.NoError(t, err)
		c.token = resp.GetToken()
		for _, cl := range clients {
			waitFor(t, 30*time.Second, "both replicas to learn the grant", func(ct assert.TestingT) {
				cctx, cancel := context.WithTimeout(c.Context(ctx), 5*time.Second)
				defer cancel()
				list, err := cl.grants.List(cctx, &pb.ListGrantsRequest{})
				if assert.NoError(ct, err, "ListGrants") {
					assert.Len(ct, list.GetGrants(), 1, "the grants the consumer sees")
				}
			}, procs[0], procs[1], agent)
		}
	}

	// The leaders: with a Lease each, both replicas.
	leading := func() (out []int) {
		for i := range replicas {
			if metric(i, "credbroker_revocation_triggers_leader") == 1 {
				out = append(out, i)
			}
		}
		return out
	}
	wantLeaders := map[leaseMode]int{leaseEach: 2, leaseShared: 1, leaseHeld: 0}[mode]
	waitFor(t, 30*time.Second, "the triggers' leaders", func(c assert.TestingT) {
		assert.Len(c, leading(), wantLeaders, "the replicas that lead the triggers")
	}, procs...)
	if mode == leaseHeld {
		intruded(t, consumers[0], stopIntruder, func() int { return len(leading()) })
		return
	}

	// Consumer 0 loses its RBAC: the leaders review the three consumers'
	// grants, and revoke consumer 0's.
	reviews := func(i int) float64 {
		return metric(i, "credbroker_hub_review_duration_seconds", `kind="SubjectAccessReview"`)
	}
	time.Sleep(time.Second) // the checks of the consumers' new RoleBindings are over; not synchronization
	before := []float64{reviews(0), reviews(1)}
	ungrant(t, consumers[0].Consumer)
	waitRefused(t, consumers[0].token)
	for _, i := range leading() {
		waitFor(t, 30*time.Second, "the leaders' reviews", func(c assert.TestingT) {
			assert.GreaterOrEqual(c, reviews(i)-before[i], float64(len(consumers)), "replica %d's SubjectAccessReviews since the change (from %v)", i, before[i])
		}, procs[i])
	}
	time.Sleep(time.Second) // twice the debounce's maximum: a replica that checks has by now; not synchronization
	after := []float64{reviews(0) - before[0], reviews(1) - before[1]}
	t.Logf("one hub RBAC change, %d leaders: SubjectAccessReviews by replica %v, %v in all, for %d consumers' live grants",
		wantLeaders, after, after[0]+after[1], len(consumers))
	assert.Equal(t, float64(wantLeaders*len(consumers)), after[0]+after[1], "the replicas' reviews of one RBAC change")
	if mode == leaseEach {
		return
	}

	// The leader dies without releasing its Lease; consumer 1 loses its
	// RBAC while no replica leads.
	leader := leading()[0]
	other := 1 - leader
	require.NoError(t, procs[leader].Signal(syscall.SIGKILL))
	require.Error(t, procs[leader].Wait())
	killed := time.Now()
	ungrant(t, consumers[1].Consumer)
	took := waitFor(t, time.Minute, "the other replica to take the triggers over", func(c assert.TestingT) {
		assert.Equal(c, 1.0, metric(other, "credbroker_revocation_triggers_leader"), "replica %d's credbroker_revocation_triggers_leader (-1: no scrape)", other)
	}, procs[other])
	waitRefused(t, consumers[1].token)
	t.Logf("leader SIGKILLed: replica %d took the triggers over %s later; the RBAC change during the takeover revoked %s after the kill",
		other, took.Round(100*time.Millisecond), time.Since(killed).Round(100*time.Millisecond))

	// And after the takeover.
	ungrant(t, consumers[2].Consumer)
	waitRefused(t, consumers[2].token)
}

// holdLease creates the Lease name in the brokers' namespace under a
// holder of its own, and renews it every 2 s until the returned func is
// called, or the test ends.
func holdLease(t *testing.T, name string) (stop func()) {
	t.Helper()
	leases := env.Hub.Client.CoordinationV1().Leases(broker.Default().PendingRevokesNamespace)
	holder, seconds := "intruder", int32(15)
	now := metav1.NewMicroTime(time.Now())
	_, err := leases.Create(t.Context(), &coordinationv1.Lease{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       coordinationv1.LeaseSpec{HolderIdentity: &holder, LeaseDurationSeconds: &seconds, AcquireTime: &now, RenewTime: &now},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	done := make(chan struct{})
	var once sync.Once
	stop = func() { once.Do(func() { close(done) }) }
	t.Cleanup(stop)
	go func() {
		for {
			select {
			case <-done:
				return
			case <-time.After(2 * time.Second):
			}
			l, err := leases.Get(context.Background(), name, metav1.GetOptions{})
			if err != nil {
				continue
			}
			now := metav1.NewMicroTime(time.Now())
			l.Spec.HolderIdentity, l.Spec.RenewTime = &holder, &now
			_, _ = leases.Update(context.Background(), l, metav1.UpdateOptions{})
		}
	}()
	return stop
}

// intruded is the end of testTriggersLeader while an intruder holds the
// Lease: c loses its RBAC and keeps its token; once the intruder stops,
// a replica leads and revokes it.
func intruded(t *testing.T, c triggerConsumer, stopIntruder func(), leaders func() int) {
	t.Helper()
	ungrant(t, c.Consumer)
	time.Sleep(15 * time.Second) // past the spoke's token cache (10 s) and a trigger's debounce; not synchronization
	review, err := spoke1.ReviewToken(t.Context(), c.token, nil)
	require.NoError(t, err)
	assert.True(t, review.Authenticated, "revoked while an intruder held the Lease")
	assert.Zero(t, leaders(), "a replica led while an intruder held the Lease")
	stopIntruder()
	stopped := time.Now()
	waitFor(t, time.Minute, "a replica to take the Lease over", func(ct assert.TestingT) { assert.Equal(ct, 1, leaders(), "the replicas that lead the triggers") })
	waitRefused(t, c.token)
	t.Logf("intruder held the Lease: no replica led, the RBAC change revoked nothing; %s after it stopped renewing, a replica led and revoked",
		time.Since(stopped).Round(100*time.Millisecond))
}

// grpcClients are a replica's TokenExchange and Grants clients.
type grpcClients struct {
	exchange pb.TokenExchangeClient
	grants   pb.GrantsClient
}

func dialReplica(t *testing.T, addr string) *grpcClients {
	t.Helper()
	client, conn, err := deployment.ExchangeClient(addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return &grpcClients{exchange: client, grants: pb.NewGrantsClient(conn)}
}

// ungrant deletes the RoleBindings of the fleet namespace that name c.
func ungrant(t *testing.T, c framework.Consumer) {
	t.Helper()
	rbac := env.Hub.Client.RbacV1().RoleBindings(framework.FleetNamespace)
	list, err := rbac.List(t.Context(), metav1.ListOptions{})
	require.NoError(t, err)
	n := 0
	for _, b := range list.Items {
		for _, s := range b.Subjects {
			if s.Kind == "ServiceAccount" && s.Namespace == c.Namespace && s.Name == c.Name {
				require.NoError(t, rbac.Delete(t.Context(), b.Name, metav1.DeleteOptions{}))
				n++
			}
		}
	}
	require.Positive(t, n, "no RoleBinding names %s", c.Username())
}

// waitRefused waits until spoke-1 refuses token: its grant was revoked.
func waitRefused(t *testing.T, token string) {
	t.Helper()
	waitFor(t, time.Minute, "the spoke to refuse the revoked token", func(c assert.TestingT) {
		review, err := spoke1.ReviewToken(t.Context(), token, nil)
		if assert.NoError(c, err, "TokenReview on spoke-1") {
			assert.False(c, review.Authenticated, "the revoked token is authenticated as %s", review.User.Username)
		}
	})
}
