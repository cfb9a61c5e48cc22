package e2e

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/credbroker/credbroker/pkg/grants"
	spokepkg "github.com/credbroker/credbroker/pkg/spoke"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// The shared environment: one hub, two spokes, two broker replicas, and an
// agent on spoke-1 and spoke-2 with a stream to each replica. Each test creates its own namespaces and
// ServiceAccounts, so tests do not depend on each other's state.
var (
	env         *framework.Env
	deployment  *framework.Deployment
	pluginBin   string
	logs        = &syncBuffer{}
	mintTimeout = 5 * time.Second
)

func TestMain(m *testing.M) {
	if job := os.Getenv(netnsHelperEnv); job != "" {
		os.Exit(runNetnsConsumer(job))
	}
	os.Exit(run(m))
}

func run(m *testing.M) int {
	flag.Parse()
	defer framework.WatchStuckTests(os.Stderr)()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dir, err := os.MkdirTemp("", "credbroker-e2e-")
	if err != nil {
		return fail(err)
	}
	defer os.RemoveAll(dir)

	pluginBin = filepath.Join(dir, "credbroker-plugin")
	if err := framework.Build(ctx, dir, "credbroker-plugin"); err != nil {
		return fail(err)
	}

	if env, err = framework.Start(ctx, framework.Options{Spokes: 2}); err != nil {
		return fail(err)
	}
	defer env.Stop()

	logger := funcr.New(func(prefix, args string) { logs.WriteString(prefix + " " + args + "\n") }, funcr.Options{})
	if deployment, err = framework.StartDeployment(ctx, env, framework.DeploymentOptions{
		Dir: dir, Log: logger, Audit: logger.WithName("audit"), MintTimeout: mintTimeout,
		// Each replica also writes its audit log as the binary does (audit_test.go).
		AuditDir: dir,
		// Two replicas that share nothing but the hub: any may serve any exchange.
		Replicas: 2,
		// The default per-consumer rate limit holds for every test.
	}); err != nil {
		return fail(err)
	}
	defer deployment.Stop()
	for _, spoke := range env.Spokes {
		if _, err := deployment.StartAgent(ctx, spoke, framework.AgentID(spoke.Name)); err != nil {
			return fail(err)
		}
	}

	code := m.Run()
	// ctx bounds the set-up; the suite may well outlast it.
	if err := revokeEveryGrant(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		code = 1
	}
	if err := deployment.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, "e2e: deployment stopped with:", err)
		code = 1
	}
	if os.Getenv("E2E_LOGS") != "" {
		fmt.Fprint(os.Stderr, logs.String())
	}
	return code
}

// revokeEveryGrant revokes, through the first replica's registry, every grant
// the agents reported, and then counts the grant Secrets left on the spokes.
// Every grant of the suite is gone already (revoked, expired, or its mint
// failed) or known to the broker, so none may be left. Only the grants of a
// ClusterProfile whose agent is gone (a test's fake agent, which binds
// nothing) may stay pending, and the running agents' pooled grants, which
// no token is bound to, stay (each agent deletes its own when it stops).
func revokeEveryGrant(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	b := deployment.Broker
	live := b.Grants().Select(grants.Selector{})
	_, pending := b.Grants().Revoke(ctx, live, "e2e: the suite ended")
	stuck := 0
	for _, g := range pending {
		cluster := g.GetCluster()
		if b.Connected(cluster.GetNamespace(), cluster.GetName()) == 0 {
			continue
		}
		stuck++
		fmt.Fprintf(os.Stderr, "e2e: grant %s of %s on %s/%s could not be revoked\n", g.GetCredentialId(),
			g.GetSubject().GetUsername(), cluster.GetNamespace(), cluster.GetName())
	}
	left, pooled := 0, 0
	for _, spoke := range env.Spokes {
		list, err := spoke.Client.CoreV1().Secrets("").List(ctx, metav1.ListOptions{FieldSelector: spokepkg.GrantFieldSelector})
		if err != nil {
			return fmt.Errorf("count the grants left on %s: %w", spoke.Name, err)
		}
		for _, g := range list.Items {
			if _, claimed := g.Annotations[spokepkg.GrantHubUserAnnotation]; !claimed {
				pooled++
				continue
			}
			fmt.Fprintf(os.Stderr, "e2e: grant %s/%s left on %s: %v\n", g.Namespace, g.Name, spoke.Name, g.Annotations)
			left++
		}
	}
	fmt.Fprintf(os.Stderr, "e2e: at the end of the suite, revoked %d live grants (%d more belong to agents no longer connected); "+
		"grant objects left on the spokes: %d, and %d pooled grants of the running agents\n", len(live)-len(pending), len(pending)-stuck, left, pooled)
	if left > 0 || stuck > 0 {
		return fmt.Errorf("%d grants of connected agents could not be revoked, and %d grant objects were left on the spokes", stuck, left)
	}
	return nil
}

func fail(err error) int {
	fmt.Fprintln(os.Stderr, "e2e: setup failed:", err)
	return 1
}

// syncBuffer collects the broker's and agents' logs, so tests can check that
// no token ever reaches them.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) WriteString(v string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.b.WriteString(v)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// consumer is a hub ServiceAccount that calls the broker.
type consumer struct {
	namespace, name string
	token           string // hub token for the broker's audience
}

func (c consumer) username() string { return "system:serviceaccount:" + c.namespace + ":" + c.name }

// newConsumer creates a hub ServiceAccount in a fresh namespace and mints
// it a hub token for audience. grant lists the ClusterProfiles it may use.
func newConsumer(t testing.TB, audience string, grant ...string) consumer {
	t.Helper()
	ctx := context.Background()
	c := consumer{namespace: uniqueName(t, "hub"), name: "consumer"}
	_, err := env.Hub.CreateServiceAccount(ctx, c.namespace, c.name, nil)
	require.NoError(t, err)
	for _, cp := range grant {
		require.NoError(t, env.Hub.GrantClusterProfileToken(ctx, framework.FleetNamespace, cp, c.namespace, c.name))
	}
	var aud []string
	if audience != "" {
		aud = []string{audience}
	}
	c.token, err = env.Hub.Token(ctx, c.namespace, c.name, aud, time.Hour)
	require.NoError(t, err)
	return c
}

// optIn creates a spoke ServiceAccount that allows the given hub usernames,
// in a fresh namespace, and returns its namespace.
func optIn(t testing.TB, spoke *framework.Cluster, name string, allowed ...string) string {
	t.Helper()
	ns := uniqueName(t, "spoke")
	var ann map[string]string
	if len(allowed) > 0 {
		ann = map[string]string{"credbroker.io/allowed-subjects": strings.Join(allowed, ",")}
	}
	sa, err := spoke.CreateServiceAccount(context.Background(), ns, name, ann)
	require.NoError(t, err)
	require.NoError(t, deployment.WaitForServiceAccount(context.Background(), spoke, sa))
	return ns
}

// optInAudiences is optIn for a ServiceAccount that also lists audiences in
// its credbroker.io/allowed-audiences annotation.
func optInAudiences(t testing.TB, spoke *framework.Cluster, name string, audiences []string, allowed ...string) string {
	t.Helper()
	ns := uniqueName(t, "spoke")
	ann := map[string]string{"credbroker.io/allowed-audiences": strings.Join(audiences, ",")}
	if len(allowed) > 0 {
		ann["credbroker.io/allowed-subjects"] = strings.Join(allowed, ",")
	}
	sa, err := spoke.CreateServiceAccount(context.Background(), ns, name, ann)
	require.NoError(t, err)
	require.NoError(t, deployment.WaitForServiceAccount(context.Background(), spoke, sa))
	return ns
}

var nameSeq struct {
	sync.Mutex
	n int
}

func uniqueName(t testing.TB, prefix string) string {
	nameSeq.Lock()
	defer nameSeq.Unlock()
	nameSeq.n++
	return fmt.Sprintf("%s-%d", prefix, nameSeq.n)
}

// exchangeClient dials the first broker's TokenExchange port, verifying it
// with the deployment's CA.
func exchangeClient(t testing.TB) pb.TokenExchangeClient {
	t.Helper()
	return exchangeClientAt(t, deployment.Broker.ExchangeAddr())
}

func exchangeClientAt(t testing.TB, addr string) pb.TokenExchangeClient {
	t.Helper()
	return pb.NewTokenExchangeClient(dialExchange(t, addr))
}

// dialExchange dials addr over TLS, verifying it with the deployment's CA.
func dialExchange(t testing.TB, addr string) *grpc.ClientConn {
	t.Helper()
	pem, err := os.ReadFile(deployment.CAFile)
	require.NoError(t, err)
	pool := x509.NewCertPool()
	require.True(t, pool.AppendCertsFromPEM(pem))
	conn, err := grpc.NewClient(addr,
		grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12})))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

func bearer(token string) context.Context {
	return metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+token)
}

func clusterRef(spoke *framework.Cluster) *pb.ObjectReference {
	return &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: spoke.Name}
}
