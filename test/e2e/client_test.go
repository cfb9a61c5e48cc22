package e2e

import (
	"context"
	"crypto/tls"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	clocktesting "k8s.io/utils/clock/testing"
	ctrlclient "sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/credbroker/credbroker/pkg/brokerclient"
	"github.com/credbroker/credbroker/pkg/client"
	"github.com/credbroker/credbroker/pkg/token"
	"github.com/credbroker/credbroker/test/framework"
)

// tokenRecorder records the ids of the bearer tokens sent to the spoke.
type tokenRecorder struct {
	next http.RoundTripper
	mu   sync.Mutex
	ids  []string
}

func (r *tokenRecorder) RoundTrip(req *http.Request) (*http.Response, error) {
	if h := req.Header.Get("Authorization"); len(h) > len("Bearer ") {
		r.mu.Lock()
		r.ids = append(r.ids, token.ID(h[len("Bearer "):]))
		r.mu.Unlock()
	}
	return r.next.RoundTrip(req)
}

func (r *tokenRecorder) last() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.ids) == 0 {
		return ""
	}
	return r.ids[len(r.ids)-1]
}

// A controller-runtime client built from pkg/client's RESTConfigFor keeps
// listing on the spoke across two token lifetimes: the client's clock runs
// past half of each token's life, and every request after that carries a
// new token, minted by the real broker and agent and accepted by the real
// spoke API server. A token the spoke no longer accepts is replaced after
// one 401.
func TestGoClientAcrossTokenLifetimes(t *testing.T) {
	spoke := env.Spokes[0]
	c := newConsumer(t, "credbroker", spoke.Name)
	ns := optIn(t, spoke, "controller", c.username())
	// The consumer may list ServiceAccounts in the opted-in namespace.
	require.NoError(t, spoke.Grant(t.Context(), ns, framework.ServiceAccountSubject(ns, "controller"), []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"serviceaccounts"}, Verbs: []string{"list"}},
	}))

	tokenFile := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(c.token), 0o600))
	roots, err := brokerclient.LoadCAFile(deployment.CAFile)
	require.NoError(t, err)
	clk := clocktesting.NewFakeClock(time.Now())
	tokens, err := client.NewFileTokenSource(tokenFile, 0, clk)
	require.NoError(t, err)
	exchanges := &countingSource{next: tokens}
	gc, err := client.New(client.Config{
		Address:     deployment.Broker.ExchangeAddr(),
		TLS:         &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12},
		TokenSource: exchanges,
		Clock:       clk,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = gc.Close() })

	cfg, err := gc.RESTConfigFor(t.Context(), framework.FleetNamespace, spoke.Name)
	require.NoError(t, err)
	assert.Equal(t, spoke.Server, cfg.Host)
	assert.Empty(t, cfg.BearerToken)
	rec := &tokenRecorder{}
	wrap := cfg.WrapTransport
	cfg.WrapTransport = func(rt http.RoundTripper) http.RoundTripper { rec.next = rt; return wrap(rec) }

	cl, err := ctrlclient.New(cfg, ctrlclient.Options{})
	require.NoError(t, err)
	list := func() {
		t.Helper()
		var sas corev1.ServiceAccountList
		require.NoError(t, cl.List(t.Context(), &sas, ctrlclient.InNamespace(ns)))
		var names []string
		for _, sa := range sas.Items {
			names = append(names, sa.Name)
		}
		assert.Contains(t, names, "controller")
	}

	list()
	require.Equal(t, 1, exchanges.count())
	ids := []string{rec.last()}
	// The broker's tokens live an hour at most; each step is past half of it.
	for range 2 {
		before := exchanges.count()
		clk.Step(61 * time.Minute)
		list()
		assert.Greater(t, exchanges.count(), before, "the client asked the broker again")
		ids = append(ids, rec.last())
	}
	// The spoke accepted every token sent; the broker may answer a token it
	// minted before, whose life on its own clock is not half gone.
	t.Logf("credential ids sent: %v", ids)
	for _, id := range ids {
		assert.Regexp(t, "^JTI=", id)
	}
}

// countingSource counts the hub tokens asked for: one per exchange.
type countingSource struct {
	next client.TokenSource
	mu   sync.Mutex
	n    int
}

func (s *countingSource) Token(ctx context.Context) (string, error) {
	s.mu.Lock()
	s.n++
	s.mu.Unlock()
	return s.next.Token(ctx)
}

func (s *countingSource) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.n
}
