package binaries

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	authenticationv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/credbroker/credbroker/pkg/errdefs"
	spokepkg "github.com/credbroker/credbroker/pkg/spoke"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

var seq atomic.Int64

// unique returns a name no other test of the run uses, with -count and
// -shuffle too.
func unique(prefix string) string { return fmt.Sprintf("%s-%d", prefix, seq.Add(1)) }

// newConsumer creates a hub ServiceAccount in a fresh namespace that may
// exchange for the given ClusterProfiles, with a token for "credbroker".
func newConsumer(t *testing.T, clusterProfiles ...string) framework.Consumer {
	t.Helper()
	c, err := env.NewConsumer(t.Context(), unique("hub"), "consumer", "credbroker", clusterProfiles...)
	require.NoError(t, err)
	minted.Lock()
	minted.hub = append(minted.hub, c.Token)
	minted.Unlock()
	return c
}

// optIn creates the spoke ServiceAccount name in a fresh namespace, which
// the given hub users may get tokens for (none: not opted in), and
// returns the namespace.
func optIn(t *testing.T, name string, allowed ...string) string {
	t.Helper()
	ns := unique("spoke")
	var ann map[string]string
	if len(allowed) > 0 {
		ann = map[string]string{"credbroker.io/allowed-subjects": strings.Join(allowed, ",")}
	}
	_, err := spoke.CreateServiceAccount(t.Context(), ns, name, ann)
	require.NoError(t, err)
	return ns
}

func clusterRef(name string) *pb.ObjectReference {
	return &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: name}
}

// exchangeClient dials the broker process's TokenExchange port.
func exchangeClient(t *testing.T) (pb.TokenExchangeClient, *grpc.ClientConn) {
	t.Helper()
	client, conn, err := deployment.ExchangeClient(exchangeAddr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return client, conn
}

// callOnce makes one exchange as c and records the token it gets.
func callOnce(t *testing.T, client pb.TokenExchangeClient, c framework.Consumer, req *pb.ExchangeRequest, opts ...grpc.CallOption) (*pb.ExchangeResponse, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(c.Context(t.Context()), 30*time.Second)
	defer cancel()
	resp, err := client.Exchange(ctx, req, opts...)
	if err == nil {
		minted.Lock()
		minted.spoke = append(minted.spoke, resp.GetToken())
		minted.Unlock()
	}
	return resp, err
}

// callOnceSeen makes the exchange again while the agent answers that the
// spoke ServiceAccount is not found, until its informer has the one the
// test just created (the process's cache cannot be asked), and returns
// the first other answer.
func callOnceSeen(t *testing.T, client pb.TokenExchangeClient, c framework.Consumer, req *pb.ExchangeRequest) (*pb.ExchangeResponse, error) {
	t.Helper()
	var resp *pb.ExchangeResponse
	var err error
	_ = wait.PollUntilContextTimeout(t.Context(), 100*time.Millisecond, 20*time.Second, true, func(context.Context) (bool, error) {
		resp, err = callOnce(t, client, c, req)
		st := status.Convert(err)
		return st.Code() != codes.NotFound || !strings.Contains(st.Message(), "agent: spoke ServiceAccount"), nil
	})
	return resp, err
}

// get fetches url and returns its status code and body.
func get(ctx context.Context, url string) (int, string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body), err
}

// scrape reads the /metrics page of addr.
func scrape(t *testing.T, addr string) *framework.Metrics {
	t.Helper()
	m, err := framework.ScrapeMetrics(t.Context(), addr)
	require.NoError(t, err)
	return m
}

// sample returns the sum of the series name{labels...} on the /metrics
// page of addr, 0 when there is none.
func sample(t *testing.T, addr, name string, labels ...string) float64 {
	t.Helper()
	return scrape(t, addr).Sum(name, labels...)
}

// --version of each binary prints the VERSION file's version and the
// revision it was built with, as `make build` links them; -v=2 before it is
// taken as the verbosity.
func TestVersion(t *testing.T) {
	for _, b := range []struct{ name, bin string }{{"broker", brokerBin}, {"spoke-agent", agentBin}} {
		for _, args := range [][]string{{"--version"}, {"-v=2", "--version"}} {
			t.Run(b.name+" "+strings.Join(args, " "), func(t *testing.T) {
				out, err := exec.CommandContext(t.Context(), b.bin, args...).CombinedOutput()
				require.NoError(t, err, string(out))
				want := regexp.MustCompile(`^` + b.name + ` ` + regexp.QuoteMeta(version) + ` \(revision ` + revision + `, go1\.\d+[^)]*\)\n$`)
				assert.Regexp(t, want, string(out))
			})
		}
	}
}

// The exchange through the processes: a consumer gets a token for a spoke
// ServiceAccount that allows it, and the spoke accepts the token as that
// ServiceAccount; the agent bound it to a grant Secret it created.
func TestExchange(t *testing.T) {
	client, _ := exchangeClient(t)
	c := newConsumer(t, spoke.Name)
	ns := optIn(t, "deployer", c.Username())
	resp, err := callOnceSeen(t, client, c, &pb.ExchangeRequest{
		Cluster: clusterRef(spoke.Name), ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: "deployer"},
	})
	require.NoError(t, err)
	assert.Equal(t, spoke.Server, resp.GetServer())
	assert.NotEmpty(t, resp.GetCredentialId())

	cs, err := kubernetes.NewForConfig(spoke.TokenConfig(resp.GetToken()))
	require.NoError(t, err)
	self, err := cs.AuthenticationV1().SelfSubjectReviews().Create(t.Context(), &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	require.NoError(t, err)
	assert.Equal(t, "system:serviceaccount:"+ns+":deployer", self.Status.UserInfo.Username)

	// The agent's pooled grants, to which no token is bound, are not
	// counted.
	grants, err := spoke.ClaimedGrants(t.Context(), ns)
	require.NoError(t, err)
	require.Len(t, grants, 1)
	assert.Equal(t, resp.GetCredentialId(), grants[0].Annotations[spokepkg.GrantCredentialIDAnnotation])
}

// The refusals through the processes, each with its code.
func TestRefusals(t *testing.T) {
	client, _ := exchangeClient(t)
	granted := newConsumer(t, spoke.Name, "missing")
	closed := optIn(t, "closed")
	forDefaultAudience, err := env.Hub.Token(t.Context(), granted.Namespace, granted.Name, nil, time.Hour)
	require.NoError(t, err)
	minted.Lock()
	minted.hub = append(minted.hub, forDefaultAudience)
	minted.Unlock()

	tests := []struct {
		name     string
		consumer framework.Consumer
		req      *pb.ExchangeRequest
		wantCode codes.Code
		wantMsg  string
	}{
		{
			name:     "no hub RBAC",
			consumer: newConsumer(t),
			req:      &pb.ExchangeRequest{Cluster: clusterRef(spoke.Name)},
			wantCode: codes.PermissionDenied, wantMsg: "hub RBAC does not allow",
		},
		{
			name:     "spoke ServiceAccount not opted in",
			consumer: granted,
			req:      &pb.ExchangeRequest{Cluster: clusterRef(spoke.Name), ServiceAccount: &pb.ObjectReference{Namespace: closed, Name: "closed"}},
			wantCode: codes.PermissionDenied, wantMsg: "credbroker.io/allowed-subjects",
		},
		{
			name:     "unknown ClusterProfile",
			consumer: granted,
			req:      &pb.ExchangeRequest{Cluster: clusterRef("missing")},
			wantCode: codes.NotFound, wantMsg: "fleet/missing",
		},
		{
			name:     "hub token for the API server's audience",
			consumer: framework.Consumer{Namespace: granted.Namespace, Name: granted.Name, Token: forDefaultAudience},
			req:      &pb.ExchangeRequest{Cluster: clusterRef(spoke.Name)},
			wantCode: codes.Unauthenticated, wantMsg: `audience "credbroker"`,
		},
		{
			name:     "not a token",
			consumer: framework.Consumer{Namespace: granted.Namespace, Name: granted.Name, Token: "not-a-token"},
			req:      &pb.ExchangeRequest{Cluster: clusterRef(spoke.Name)},
			wantCode: codes.Unauthenticated,
		},
		{
			name: "hub token with a forged signature",
			consumer: framework.Consumer{Namespace: granted.Namespace, Name: granted.Name,
				Token: granted.Token[:strings.LastIndex(granted.Token, ".")+1] + "AAAA"},
			req:      &pb.ExchangeRequest{Cluster: clusterRef(spoke.Name)},
			wantCode: codes.Unauthenticated,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := callOnceSeen(t, client, tt.consumer, tt.req)
			st := status.Convert(err)
			assert.Equal(t, tt.wantCode, st.Code(), st.Message())
			assert.Contains(t, st.Message(), tt.wantMsg)
		})
	}
}

// The second exchange of the same request is served from the broker's
// cache: the same credential, counted as a hit on /metrics, and audited
// as one on standard output (the default --audit-log-path).
func TestCachedExchange(t *testing.T) {
	client, _ := exchangeClient(t)
	c := newConsumer(t, spoke.Name)
	ns := optIn(t, "cached", c.Username())
	req := &pb.ExchangeRequest{Cluster: clusterRef(spoke.Name), ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: "cached"}}
	first, err := callOnceSeen(t, client, c, req)
	require.NoError(t, err)
	hits := sample(t, brokerMetrics, "credbroker_exchanges_total", `cache="hit"`, `code="OK"`)
	second, err := callOnce(t, client, c, req)
	require.NoError(t, err)
	assert.Equal(t, first.GetCredentialId(), second.GetCredentialId())
	assert.Equal(t, first.GetToken(), second.GetToken())
	assert.Equal(t, hits+1, sample(t, brokerMetrics, "credbroker_exchanges_total", `cache="hit"`, `code="OK"`))

	var audited []bool
	for line := range strings.Lines(broker.Output()) {
		var rec map[string]any
		if json.Unmarshal([]byte(line), &rec) != nil || rec["credentialID"] != first.GetCredentialId() {
			continue
		}
		hit, _ := rec["cacheHit"].(bool)
		audited = append(audited, hit)
	}
	assert.Equal(t, []bool{false, true}, audited, "the audit lines of the credential: a miss, then a hit")
}

// /metrics, /healthz and /readyz of both processes, and gRPC health on the
// broker's exchange port.
func TestHealthAndMetrics(t *testing.T) {
	for _, p := range []struct {
		name, addr, metric, build string
	}{
		{"broker", brokerMetrics, "credbroker_connected_clusters", "credbroker_build_info"},
		{"spoke-agent", agentMetrics, "credbroker_agent_broker_streams", "credbroker_agent_build_info"},
	} {
		t.Run(p.name, func(t *testing.T) {
			for _, path := range []string{"/healthz", "/readyz"} {
				code, body, err := get(t.Context(), "http://"+p.addr+path)
				require.NoError(t, err)
				assert.Equal(t, http.StatusOK, code, "%s: %s", path, body)
			}
			m := scrape(t, p.addr)
			assert.Equal(t, 1.0, m.Sum(p.metric), "one agent stream, one connected cluster: %s", m.Text)
			assert.Equal(t, 1.0, sample(t, p.addr, p.build, `version="`+version+`"`, `revision="`+revision+`"`), "built with the Makefile's ldflags")
		})
	}
	t.Run("gRPC health of the exchange port", func(t *testing.T) {
		_, conn := exchangeClient(t)
		resp, err := healthpb.NewHealthClient(conn).Check(t.Context(), &healthpb.HealthCheckRequest{})
		require.NoError(t, err)
		assert.Equal(t, healthpb.HealthCheckResponse_SERVING, resp.GetStatus())
	})
}

// The default per-consumer limit, with the burst an operator lowered to
// rateBurst: a consumer that asks for more mints at once than the burst
// is refused with ResourceExhausted and a retry-after trailer, and the
// others of its calls go through.
func TestRateLimit(t *testing.T) {
	client, _ := exchangeClient(t)
	c := newConsumer(t, spoke.Name)
	// ServiceAccounts that do not exist: each call is a mint the agent
	// refuses at once, and costs one of the burst.
	req := func(i int) *pb.ExchangeRequest {
		return &pb.ExchangeRequest{Cluster: clusterRef(spoke.Name), ServiceAccount: &pb.ObjectReference{Namespace: "absent", Name: fmt.Sprintf("sa-%d", i)}}
	}
	// The TokenReview and the SubjectAccessReview, cached from here on.
	_, err := callOnce(t, client, c, req(0))
	require.Equal(t, codes.NotFound, status.Code(err), "%v", err)

	const n = 40
	codesSeen := make([]codes.Code, n)
	trailers := make([]metadata.MD, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			_, err := callOnce(t, client, c, req(i+1), grpc.Trailer(&trailers[i]))
			codesSeen[i] = status.Code(err)
			if status.Code(err) == codes.ResourceExhausted {
				assert.Contains(t, status.Convert(err).Message(), fmt.Sprintf("burst %d", rateBurst))
			}
		})
	}
	wg.Wait()
	count := map[codes.Code]int{}
	for i, code := range codesSeen {
		count[code]++
		if code != codes.ResourceExhausted {
			continue
		}
		after := trailers[i].Get(errdefs.RetryAfterKey)
		if assert.Len(t, after, 1, "a refusal without %s", errdefs.RetryAfterKey) {
			secs, err := strconv.Atoi(after[0])
			assert.NoError(t, err)
			assert.GreaterOrEqual(t, secs, 1)
		}
	}
	t.Logf("%d concurrent mints with --rate-burst=%d: %v", n, rateBurst, count)
	assert.Equal(t, n, count[codes.NotFound]+count[codes.ResourceExhausted], "only the agent's NotFound or the limit: %v", count)
	assert.Positive(t, count[codes.ResourceExhausted], "no call was limited")
	assert.Positive(t, count[codes.NotFound], "every call was limited")
}

// The hub stores no spoke token: after exchanges of its own (and those of
// the tests before it), no Secret or ConfigMap on the hub holds a token
// the suite saw, and neither process wrote one. TestMain checks the
// processes' output again after the whole suite.
func TestNoTokenOnHub(t *testing.T) {
	client, _ := exchangeClient(t)
	c := newConsumer(t, spoke.Name)
	ns := optIn(t, "stored", c.Username())
	_, err := callOnceSeen(t, client, c, &pb.ExchangeRequest{Cluster: clusterRef(spoke.Name), ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: "stored"}})
	require.NoError(t, err)

	stored, err := hubSecretsAndConfigMaps(t.Context())
	require.NoError(t, err)
	minted.Lock()
	tokens := append(append([]string(nil), minted.spoke...), minted.hub...)
	minted.Unlock()
	require.NotEmpty(t, tokens)
	out := broker.Output() + agent.Output()
	for _, tok := range tokens {
		for _, v := range stored {
			assert.NotContains(t, v, tok, "a token is stored on the hub")
		}
		assert.False(t, strings.Contains(out, tok), "a token reached a process's output")
	}
}

// Revocation through the processes: deleting the consumer's hub
// ServiceAccount makes the broker (watching ServiceAccounts, as deploy/hub
// lets it) revoke its grant, and the agent deletes the grant Secret (as
// deploy/spoke lets it), which invalidates the token on the spoke.
func TestRevokeOnConsumerDeleted(t *testing.T) {
	client, _ := exchangeClient(t)
	c := newConsumer(t, spoke.Name)
	ns := optIn(t, "revoked", c.Username())
	resp, err := callOnceSeen(t, client, c, &pb.ExchangeRequest{Cluster: clusterRef(spoke.Name), ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: "revoked"}})
	require.NoError(t, err)
	// The token works (TestExchange); it is not reviewed here, so that the
	// spoke API server's authentication cache (10s) does not hold it.
	grants, err := spoke.ClaimedGrants(t.Context(), ns)
	require.NoError(t, err)
	require.Len(t, grants, 1)

	require.NoError(t, env.Hub.Client.CoreV1().ServiceAccounts(c.Namespace).Delete(t.Context(), c.Name, metav1.DeleteOptions{}))
	var last string
	err = wait.PollUntilContextTimeout(t.Context(), 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		review, err := spoke.ReviewToken(ctx, resp.GetToken(), nil)
		if err != nil {
			return false, err
		}
		last = fmt.Sprintf("authenticated %t as %q, error %q", review.Authenticated, review.User.Username, review.Error)
		return !review.Authenticated, nil
	})
	require.NoError(t, err, "the spoke still accepts the token of a deleted consumer (last review: %s)", last)
	grants, err = spoke.ClaimedGrants(t.Context(), ns)
	require.NoError(t, err)
	assert.Empty(t, grants)
}

// Both processes still run: no test above ended one.
func TestProcessesAlive(t *testing.T) {
	for _, p := range []*framework.Process{broker, agent} {
		// The null signal only checks that the process is there.
		assert.NoError(t, p.Signal(syscall.Signal(0)))
	}
}
