package bench

import (
	"context"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/credbroker/credbroker/pkg/hubauth"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

const (
	// consumerNS is the hub namespace of the consumers; its ServiceAccounts
	// group may exchange tokens for every ClusterProfile of the fleet.
	consumerNS = "bench"
	// targetNS/targetSA is the spoke ServiceAccount every exchange asks for.
	targetNS, targetSA = "bench", "target"
	// coldAudiences is the size of the pool of audiences that the target
	// allows: each cold exchange takes a new one, so its key is not cached.
	coldAudiences = 600
	// maxConsumers is the most concurrent consumers of scenario a.
	maxConsumers = 64
)

// consumerLimits are the broker flags that an operator sizing the broker
// for these consumers would raise: the per-consumer limit of mints and hub
// reviews, and the TokenReview limits of new tokens (the load generator's
// consumers all come from 127.0.0.1 and one hub namespace, where a
// fleet's come from many pods and namespaces).
var consumerLimits = []string{
	"--rate-limit=1000000", "--rate-burst=1000000",
	"--review-rate-limit=100000", "--review-burst=100000",
	"--peer-review-rate-limit=100000", "--peer-review-burst=100000",
	"--namespace-review-rate-limit=100000", "--namespace-review-burst=100000",
}

// brokerProc is the broker binary under test.
type brokerProc struct {
	*framework.Process
	exchange, agent, metrics string
}

// bench is what the scenarios share.
type bench struct {
	// root is the whole run's test: the processes live until it ends.
	root      *testing.T
	broker    brokerProc
	agent     *framework.Process
	consumers []framework.Consumer
	// clients are one connection to the broker per consumer.
	clients []pb.TokenExchangeClient
	nextAud atomic.Int64
}

func (b *bench) coldAudience(t testing.TB) string {
	n := b.nextAud.Add(1) - 1
	require.Less(t, n, int64(coldAudiences), "the pool of cold audiences is spent")
	return fmt.Sprintf("cold-%d", n)
}

func exchangeRequest(cluster string, audiences ...string) *pb.ExchangeRequest {
	return &pb.ExchangeRequest{
		Cluster:        &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: cluster},
		ServiceAccount: &pb.ObjectReference{Namespace: targetNS, Name: targetSA},
		Audiences:      audiences,
	}
}

func bearer(ctx context.Context, token string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
}

// TestBench runs every scenario in order and prints the table.
func TestBench(t *testing.T) {
	began := time.Now()
	ctx := t.Context()
	b := setup(t)
	t.Run("a_cached", func(t *testing.T) { b.cached(t) })
	t.Run("b_cold", func(t *testing.T) { b.cold(t) })
	t.Run("c_herd", func(t *testing.T) { b.herd(t) })
	t.Run("d_spoke_load", func(t *testing.T) { b.spokeLoad(t) })
	t.Run("e_agent_qps", func(t *testing.T) { b.agentQPS(t) })
	t.Run("g_plugin", func(t *testing.T) { b.plugin(t) })
	t.Run("h_data_path", func(t *testing.T) { b.dataPath(t) })
	t.Run("profile", func(t *testing.T) { b.profile(t) })
	_ = ctx

	text := render("make bench", "", time.Since(began))
	fmt.Println("\n" + text)
	if path := os.Getenv("CREDBROKER_BENCH_DOC"); path != "" {
		require.NoError(t, writeDoc(path, text))
		t.Logf("wrote the table to %s", path)
	}
}

// startBroker runs the broker binary on new ports, with the profiling
// endpoint, an audit log file named name, the raised consumer limits, and
// args.
func startBroker(t *testing.T, name string, args ...string) brokerProc {
	var bp brokerProc
	var err error
	for _, p := range []*string{&bp.exchange, &bp.agent, &bp.metrics} {
		*p, err = framework.FreeAddr()
		require.NoError(t, err)
	}
	all := append([]string{"--profiling", "--audit-log-path=" + workDir + "/" + name}, consumerLimits...)
	bp.Process, err = deployment.StartBrokerProcess(framework.BrokerProcessOptions{
		Bin: brokerBin, ExchangeAddress: bp.exchange, AgentAddress: bp.agent, MetricsAddress: bp.metrics, Args: append(all, args...),
	})
	require.NoError(t, err)
	t.Cleanup(func() { bp.Stop() })
	return bp
}

func setup(t *testing.T) *bench {
	ctx := t.Context()
	b := &bench{root: t}
	var err error
	b.broker = startBroker(t, "audit.log")

	// Consumers: distinct hub ServiceAccounts, allowed by their group.
	group := "system:serviceaccounts:" + consumerNS
	require.NoError(t, env.Hub.Grant(ctx, framework.FleetNamespace, rbacv1.Subject{Kind: rbacv1.GroupKind, Name: group},
		[]rbacv1.PolicyRule{framework.ClusterProfileTokenRule()}))
	b.consumers = make([]framework.Consumer, maxConsumers)
	for i := range b.consumers {
		c := framework.Consumer{Namespace: consumerNS, Name: fmt.Sprintf("consumer-%d", i)}
		_, err := env.Hub.CreateServiceAccount(ctx, c.Namespace, c.Name, nil)
		require.NoError(t, err)
		c.Token, err = env.Hub.Token(ctx, c.Namespace, c.Name, []string{"credbroker"}, time.Hour)
		require.NoError(t, err)
		b.consumers[i] = c
		client, conn, err := deployment.ExchangeClient(b.broker.exchange)
		require.NoError(t, err)
		t.Cleanup(func() { conn.Close() })
		b.clients = append(b.clients, client)
	}
	// The spoke ServiceAccount they exchange for, with the cold audiences.
	auds := make([]string, coldAudiences)
	for i := range auds {
		auds[i] = fmt.Sprintf("cold-%d", i)
	}
	_, err = spoke.CreateServiceAccount(ctx, targetNS, targetSA, map[string]string{
		"credbroker.io/allowed-subjects":  "group:" + group,
		"credbroker.io/allowed-audiences": strings.Join(append(auds, "cached"), ","),
	})
	require.NoError(t, err)

	b.agent = b.startAgent(t, spoke.Name)
	return b
}

// startAgent runs the agent binary for the ClusterProfile fleet/profile on
// the spoke, with args, and returns once the broker serves a cold exchange
// through it.
func (b *bench) startAgent(t *testing.T, profile string, args ...string) *framework.Process {
	p := b.runAgent(t, profile, args...)
	b.waitServes(t, profile, p)
	return p
}

// runAgent runs the agent binary for fleet/profile with args.
func (b *bench) runAgent(t *testing.T, profile string, args ...string) *framework.Process {
	p, err := deployment.StartAgentProcess(t.Context(), spoke, framework.AgentProcessOptions{
		Bin: agentBin, BrokerAddresses: []string{b.broker.agent}, ClusterProfile: profile, Args: args,
	})
	require.NoError(t, err)
	b.root.Cleanup(p.Stop)
	return p
}

// waitServes returns once the broker serves a cold exchange for profile.
func (b *bench) waitServes(t *testing.T, profile string, p *framework.Process) {
	b.waitServesVia(t, b.clients[0], b.broker, profile, p)
}

// waitServesVia returns once broker serves, through client, a cold
// exchange for profile.
func (b *bench) waitServesVia(t *testing.T, client pb.TokenExchangeClient, broker brokerProc, profile string, p *framework.Process) {
	deadline := time.Now().Add(time.Minute)
	for {
		// A readiness check that the cache cannot answer: the default
		// audiences of a consumer that has never asked for this cluster
		// would be cached after the first success, so each try asks for a
		// new audience... only until one succeeds.
		ctx, cancel := context.WithTimeout(bearer(t.Context(), b.consumers[0].Token), 5*time.Second)
		_, err := client.Exchange(ctx, exchangeRequest(profile, b.coldAudience(t)))
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the agent of %s did not serve: %v\nagent:\n%s\nbroker:\n%s", profile, err, tail(p.Output()), tail(broker.Output()))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func tail(s string) string {
	if len(s) > 4000 {
		return s[len(s)-4000:]
	}
	return s
}

// directClients are spoke clientsets as the admin, each with a transport
// of its own (a custom Dial is never shared), unthrottled, as consumers
// that each call TokenRequest themselves would be.
func directClients(t *testing.T, n int, cluster *framework.Cluster) []kubernetes.Interface {
	out := make([]kubernetes.Interface, n)
	for i := range out {
		out[i] = unthrottledClient(t, cluster.Config)
	}
	return out
}

// unthrottledClient is a clientset of cfg on a transport of its own, with
// the client-side rate limit off.
func unthrottledClient(t *testing.T, cfg *rest.Config) kubernetes.Interface {
	cfg = rest.CopyConfig(cfg)
	cfg.QPS, cfg.Burst = -1, 0
	cfg.Dial = (&net.Dialer{}).DialContext
	c, err := kubernetes.NewForConfig(cfg)
	require.NoError(t, err)
	return c
}

// grantedTokenRequest does, directly, the three spoke requests of a mint
// without the grant pool: a grant Secret, a TokenRequest bound to it, and
// a patch that records the token on it.
func grantedTokenRequest(ctx context.Context, c kubernetes.Interface, audience string) error {
	secret, err := c.CoreV1().Secrets(targetNS).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{GenerateName: "bench-grant-"}}, metav1.CreateOptions{})
	if err != nil {
		return err
	}
	if err := boundTokenRequest(ctx, c, secret, audience); err != nil {
		return err
	}
	_, err = c.CoreV1().Secrets(targetNS).Patch(ctx, secret.Name, types.MergePatchType,
		[]byte(`{"metadata":{"annotations":{"bench/minted":"true"}}}`), metav1.PatchOptions{})
	return err
}

// boundTokenRequest asks for a token bound to secret, which exists: the
// one spoke request of a mint with the grant pool.
func boundTokenRequest(ctx context.Context, c kubernetes.Interface, secret *corev1.Secret, audience string) error {
	_, err := c.CoreV1().ServiceAccounts(targetNS).CreateToken(ctx, targetSA, &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{
		Audiences:      []string{audience},
		BoundObjectRef: &authenticationv1.BoundObjectReference{Kind: "Secret", APIVersion: "v1", Name: secret.Name, UID: secret.UID},
	}}, metav1.CreateOptions{})
	return err
}

func tokenRequest(ctx context.Context, c kubernetes.Interface, audience string) error {
	_, err := c.CoreV1().ServiceAccounts(targetNS).CreateToken(ctx, targetSA,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{Audiences: []string{audience}}}, metav1.CreateOptions{})
	return err
}

// cached is scenario a: cached exchanges beside the echo and direct
// TokenRequests, at 1, 16 and 64 concurrent consumers.
func (b *bench) cached(t *testing.T) {
	ctx := t.Context()
	// Warm every consumer's token; the answer's size sizes the echo.
	req := exchangeRequest(spoke.Name, "cached")
	callCtx := make([]context.Context, maxConsumers)
	size := 0
	for i, c := range b.consumers {
		callCtx[i] = bearer(ctx, c.Token)
		resp, err := b.clients[i].Exchange(callCtx[i], req)
		require.NoError(t, err)
		size = proto.Size(resp)
	}
	echoProc, echoConns, err := startEcho(ctx, size, maxConsumers)
	require.NoError(t, err)
	defer echoProc.Stop()
	direct := directClients(t, maxConsumers, spoke)

	warmup, measure := 500*time.Millisecond, 3*time.Second
	for _, n := range []int{1, 16, 64} {
		ex := load(ctx, n, warmup, measure, func(ctx context.Context, w int) error {
			_, err := b.clients[w].Exchange(callCtx[w], req)
			return err
		})
		ec := load(ctx, n, warmup, measure, func(ctx context.Context, w int) error { return echo(ctx, echoConns[w]) })
		tr := load(ctx, n, warmup, measure, func(ctx context.Context, w int) error { return tokenRequest(ctx, direct[w], "direct") })
		for _, r := range []loadResult{ex, ec, tr} {
			require.NoError(t, r.err)
		}
		scen := fmt.Sprintf("a. cached exchange, %d consumer(s)", n)
		vsEcho, vsTR := ex.rps()/ec.rps(), ex.rps()/tr.rps()
		targetEcho, targetTR, targetP99 := "", "", ""
		vEcho, vTR, vP99 := "", "", ""
		if n == 64 {
			targetEcho, targetTR, targetP99 = "≥ 0.80 of echo", "≥ 20× TokenRequest", "p99 ≤ 2 ms"
			vEcho, vTR, vP99 = verdict(vsEcho >= 0.8), verdict(vsTR >= 20), verdict(ex.q(0.99) <= 2*time.Millisecond)
			if ceiling := ec.rps() / tr.rps(); vsTR < 20 && ceiling < 20 {
				// No exchange outruns the echo: on this machine the
				// target is out of reach of any broker.
				vTR = fmt.Sprintf("missed; the echo itself is %.1f×", ceiling)
			}
		}
		addRow(row{scen, "throughput vs echo", fmt.Sprintf("%.0f/s", ex.rps()), fmt.Sprintf("echo %.0f/s", ec.rps()),
			fmt.Sprintf("%.2f", vsEcho), targetEcho, vEcho})
		addRow(row{scen, "throughput vs TokenRequest", fmt.Sprintf("%.0f/s", ex.rps()), fmt.Sprintf("TokenRequest %.0f/s", tr.rps()),
			fmt.Sprintf("%.1f×", vsTR), targetTR, vTR})
		addRow(row{scen, "latency p50 / p99 / p99.9", lat3(ex),
			fmt.Sprintf("echo %s; TokenRequest %s", lat3(ec), lat3(tr)),
			fmt.Sprintf("p99 %.1f× echo", float64(ex.q(0.99))/float64(ec.q(0.99))), targetP99, vP99})
		t.Logf("%d consumers: exchange %.0f/s %s; echo %.0f/s %s; TokenRequest %.0f/s %s", n,
			ex.rps(), lat3(ex), ec.rps(), lat3(ec), tr.rps(), lat3(tr))
	}
	b.cachedBatch(t, callCtx, echoConns, size, warmup, measure)
	addNote("a: each consumer is a distinct hub ServiceAccount with its own TLS connection to the broker process; "+
		"the echo (a separate process, grpc-go, the broker's serving certificate) answers %d bytes, an exchange answer's size; "+
		"TokenRequest is a direct CreateToken as the spoke admin, one connection per consumer, unthrottled. "+
		"Each level runs %s after %s of warm-up. The broker runs with %s (per-consumer and review limits raised, as an operator sizing it would; "+
		"cached answers spend no limit anyway). The rows without a mode are the default --audit-log-mode=blocking (one write(2) per audit line, "+
		"to a file); the rows marked --audit-log-mode=batch are a second broker process, with its own agent, idle until then, measured after the "+
		"first beside a new echo run at the same concurrency.", size, measure, warmup, strings.Join(consumerLimits, " "))
}

// cachedBatch is scenario a again on a broker with --audit-log-mode=batch,
// beside the echo at the same concurrency.
func (b *bench) cachedBatch(t *testing.T, callCtx []context.Context, echoConns []*grpc.ClientConn, size int, warmup, measure time.Duration) {
	ctx := t.Context()
	bp := startBroker(t, "audit-batch.log", "--audit-log-mode=batch")
	clients := make([]pb.TokenExchangeClient, maxConsumers)
	for i := range clients {
		var conn *grpc.ClientConn
		var err error
		clients[i], conn, err = deployment.ExchangeClient(bp.exchange)
		require.NoError(t, err)
		t.Cleanup(func() { conn.Close() })
	}
	agent, err := deployment.StartAgentProcess(ctx, spoke, framework.AgentProcessOptions{
		Bin: agentBin, BrokerAddresses: []string{bp.agent}, ClusterProfile: spoke.Name,
	})
	require.NoError(t, err)
	defer agent.Stop()
	b.waitServesVia(t, clients[0], bp, spoke.Name, agent)
	req := exchangeRequest(spoke.Name, "cached")
	for i := range clients {
		_, err := clients[i].Exchange(callCtx[i], req)
		require.NoError(t, err)
	}
	for _, n := range []int{1, 16, 64} {
		ex := load(ctx, n, warmup, measure, func(ctx context.Context, w int) error {
			_, err := clients[w].Exchange(callCtx[w], req)
			return err
		})
		ec := load(ctx, n, warmup, measure, func(ctx context.Context, w int) error { return echo(ctx, echoConns[w]) })
		require.NoError(t, ex.err)
		require.NoError(t, ec.err)
		scen := fmt.Sprintf("a. cached exchange, %d consumer(s), --audit-log-mode=batch", n)
		vsEcho := ex.rps() / ec.rps()
		target, v := "", ""
		if n == 64 {
			target, v = "≥ 0.80 of echo", verdict(vsEcho >= 0.8)
		}
		addRow(row{scen, "throughput vs echo", fmt.Sprintf("%.0f/s", ex.rps()), fmt.Sprintf("echo %.0f/s", ec.rps()),
			fmt.Sprintf("%.2f", vsEcho), target, v})
		addRow(row{scen, "latency p50 / p99 / p99.9", lat3(ex), "echo " + lat3(ec),
			fmt.Sprintf("p99 %.1f× echo", float64(ex.q(0.99))/float64(ec.q(0.99))), "", ""})
		t.Logf("%d consumers, batch audit: exchange %.0f/s %s; echo %.0f/s %s", n, ex.rps(), lat3(ex), ec.rps(), lat3(ec))
	}
}

func lat3(r loadResult) string {
	return fmt.Sprintf("%s / %s / %s", ms(r.q(0.5)), ms(r.q(0.99)), ms(r.q(0.999)))
}

// cold is scenario b: sequential cold exchanges beside the direct calls the
// broker makes for them, with the decisions cached (one hub token) and
// uncached (a new hub token each time, so a TokenReview and, since the
// token's credential ID is part of the user, a SubjectAccessReview).
func (b *bench) cold(t *testing.T) {
	ctx := t.Context()
	const n = 60
	c := b.consumers[0]
	fresh := make([]string, 2*n)
	for i := range fresh {
		var err error
		fresh[i], err = env.Hub.Token(ctx, c.Namespace, c.Name, []string{"credbroker"}, time.Hour)
		require.NoError(t, err)
	}
	spokeClient := directClients(t, 1, spoke)[0]
	hubClient := directClients(t, 1, env.Hub)[0]
	bound, err := spokeClient.CoreV1().Secrets(targetNS).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{GenerateName: "bench-bound-"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	missesBefore, err := brokerMetric(ctx, b.broker.metrics, "credbroker_decision_cache_lookups_total", `cache="authz"`, `result="miss"`)
	require.NoError(t, err)
	calls, err := sequential(n, func(i int) ([]time.Duration, error) {
		var parts []time.Duration
		timed := func(fn func() error) error {
			start := time.Now()
			err := fn()
			parts = append(parts, time.Since(start))
			return err
		}
		// 0: cold exchange, decisions cached.
		if err := timed(func() error {
			_, err := b.clients[0].Exchange(bearer(ctx, c.Token), exchangeRequest(spoke.Name, b.coldAudience(t)))
			return err
		}); err != nil {
			return nil, err
		}
		// 1: direct TokenRequest.
		if err := timed(func() error { return tokenRequest(ctx, spokeClient, fmt.Sprintf("direct-%d", i)) }); err != nil {
			return nil, err
		}
		// 2: cold exchange, decisions uncached.
		if err := timed(func() error {
			_, err := b.clients[0].Exchange(bearer(ctx, fresh[2*i]), exchangeRequest(spoke.Name, b.coldAudience(t)))
			return err
		}); err != nil {
			return nil, err
		}
		// 3, 4, 5: direct TokenReview, SubjectAccessReview, TokenRequest.
		var user hubauth.User
		if err := timed(func() error {
			r, err := hubClient.AuthenticationV1().TokenReviews().Create(ctx, &authenticationv1.TokenReview{
				Spec: authenticationv1.TokenReviewSpec{Token: fresh[2*i+1], Audiences: []string{"credbroker"}}}, metav1.CreateOptions{})
			if err == nil {
				st := r.Status
				user = hubauth.User{Username: st.User.Username, UID: st.User.UID, Groups: st.User.Groups, Extra: st.User.Extra}
			}
			return err
		}); err != nil {
			return nil, err
		}
		if err := timed(func() error {
			_, err := hubClient.AuthorizationV1().SubjectAccessReviews().Create(ctx,
				hubauth.AccessReview(user, "create", types.NamespacedName{Namespace: framework.FleetNamespace, Name: spoke.Name}), metav1.CreateOptions{})
			return err
		}); err != nil {
			return nil, err
		}
		if err := timed(func() error { return tokenRequest(ctx, spokeClient, fmt.Sprintf("direct-u-%d", i)) }); err != nil {
			return nil, err
		}
		// 6: what the agent asks of the spoke for one mint without its
		// grant pool: a grant Secret, a TokenRequest bound to it, and a
		// patch of the Secret.
		if err := timed(func() error { return grantedTokenRequest(ctx, spokeClient, fmt.Sprintf("direct-g-%d", i)) }); err != nil {
			return nil, err
		}
		// 7: the one spoke request of a mint with the grant pool: a
		// TokenRequest bound to a Secret that exists.
		if err := timed(func() error { return boundTokenRequest(ctx, spokeClient, bound, fmt.Sprintf("direct-b-%d", i)) }); err != nil {
			return nil, err
		}
		return parts, nil
	})
	require.NoError(t, err)
	missesAfter, err := brokerMetric(ctx, b.broker.metrics, "credbroker_decision_cache_lookups_total", `cache="authz"`, `result="miss"`)
	require.NoError(t, err)

	sums := make([][]time.Duration, len(calls))
	for i, p := range calls {
		sums[i] = []time.Duration{p[3] + p[4] + p[5]}
	}
	coldC, trC := column(calls, 0), column(calls, 1)
	coldU, directU := column(calls, 2), column(sums, 0)
	granted, boundTR := column(calls, 6), column(calls, 7)
	over := func(a, b []time.Duration, p float64) time.Duration { return quantile(a, p) - quantile(b, p) }
	for _, r := range []struct {
		name       string
		cold, base []time.Duration
		baseName   string
	}{
		{"b. cold exchange, decisions cached", coldC, trC, "TokenRequest"},
		{"b. cold exchange, decisions uncached", coldU, directU, "TokenReview + SubjectAccessReview + TokenRequest"},
		{"b. cold exchange, decisions cached, beside a mint's spoke requests without the grant pool", coldC, granted, "grant Secret create + bound TokenRequest + grant patch"},
		{"b. cold exchange, decisions cached, beside a mint's spoke request with the grant pool", coldC, boundTR, "TokenRequest bound to an existing Secret"},
	} {
		o50 := over(r.cold, r.base, 0.5)
		addRow(row{r.name, "p50 / p99", ms(quantile(r.cold, 0.5)) + " / " + ms(quantile(r.cold, 0.99)),
			r.baseName + " " + ms(quantile(r.base, 0.5)) + " / " + ms(quantile(r.base, 0.99)),
			fmt.Sprintf("overhead %s / %s", ms(o50), ms(over(r.cold, r.base, 0.99))),
			"overhead p50 ≤ 1 ms", verdict(o50 <= time.Millisecond)})
	}
	addNote("b: %d sequential iterations, each a cold exchange (a new audience) with the consumer's cached decisions, a direct TokenRequest, "+
		"a cold exchange with a new hub token (the broker's SubjectAccessReview cache missed %.0f times in %d such exchanges: "+
		"the token's credential ID is part of the user), and the direct TokenReview, SubjectAccessReview and TokenRequest of another new token. "+
		"Overhead is the difference of the quantiles. With its grant pool (the default --grant-pool-size=2), the agent answers a mint after one spoke request, "+
		"the TokenRequest bound to a grant Secret created ahead; the grant's claim (a patch) and the pool's refill (a create) follow the answer. "+
		"The third row compares with the three requests of a mint without the pool (grant Secret create, TokenRequest bound to it, grant patch), "+
		"as with --grant-pool-size=0 and for the first mint of a ServiceAccount; the fourth with the one request of a mint with the pool, "+
		"a TokenRequest bound to a Secret that exists (the spoke API server reads the Secret to bind the token to it).",
		n, missesAfter-missesBefore, n)
}

// herd is scenario c: 1,000 concurrent exchanges for one key not cached,
// counted by the spoke API server.
func (b *bench) herd(t *testing.T) {
	ctx := t.Context()
	const n, conns = 1000, 16
	c := b.consumers[1]
	callCtx := bearer(ctx, c.Token)
	// The consumer's decisions are cached first: the herd is on the token.
	_, err := b.clients[1].Exchange(callCtx, exchangeRequest(spoke.Name, "cached"))
	require.NoError(t, err)
	req := exchangeRequest(spoke.Name, b.coldAudience(t))
	before, err := spokeTokenRequests(ctx)
	require.NoError(t, err)
	var (
		wg     sync.WaitGroup
		start  = make(chan struct{})
		failed atomic.Int64
		ids    sync.Map
	)
	for i := range n {
		wg.Go(func() {
			<-start
			resp, err := b.clients[2+i%conns].Exchange(callCtx, req)
			if err != nil {
				failed.Add(1)
				return
			}
			ids.Store(resp.GetCredentialId(), true)
		})
	}
	close(start)
	wg.Wait()
	after, err := spokeTokenRequests(ctx)
	require.NoError(t, err)
	distinct := 0
	ids.Range(func(any, any) bool { distinct++; return true })
	got := after - before
	addRow(row{"c. herd: 1,000 concurrent exchanges of one uncached key", "spoke TokenRequests (apiserver_request_total)",
		fmt.Sprintf("%.0f", got), fmt.Sprintf("%d if each minted", n), fmt.Sprintf("%.3f", got/n), "= 1", verdict(got == 1)})
	addNote("c: %d exchanges over %d connections, released together; %d failed; %d distinct credential IDs answered. "+
		"The count is the spoke kube-apiserver's own apiserver_request_total{resource=\"serviceaccounts\",subresource=\"token\"}, before and after.",
		n, conns, failed.Load(), distinct)
	require.Zero(t, failed.Load())
	require.Equal(t, 1.0, got, "the herd must cost the spoke exactly one TokenRequest")
}
