package e2e

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	authenticationv1 "k8s.io/api/authentication/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/cluster-inventory-api/pkg/access"

	"github.com/credbroker/credbroker/pkg/plugin"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// minted collects every spoke token the tests received, to check at the end
// that none of them is stored on the hub or written to a log.
var minted struct {
	sync.Mutex
	tokens []string
}

func exchange(t testing.TB, c consumer, req *pb.ExchangeRequest) (*pb.ExchangeResponse, error) {
	t.Helper()
	return exchangeVia(t, exchangeClient(t), c, req)
}

func exchangeVia(t testing.TB, client pb.TokenExchangeClient, c consumer, req *pb.ExchangeRequest) (*pb.ExchangeResponse, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(bearer(c.token), 30*time.Second)
	defer cancel()
	resp, err := client.Exchange(ctx, req)
	if err == nil {
		minted.Lock()
		minted.tokens = append(minted.tokens, resp.GetToken())
		minted.Unlock()
	}
	return resp, err
}

// claims decodes a JWT's payload; the spoke API server verifies the token,
// the tests only read what it says.
func claims(t *testing.T, tok string) (c struct {
	Aud []string `json:"aud"`
	Exp int64    `json:"exp"`
	Sub string   `json:"sub"`
}) {
	t.Helper()
	parts := strings.Split(tok, ".")
	require.Len(t, parts, 3)
	raw, err := base64.RawURLEncoding.DecodeString(parts[1])
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(raw, &c))
	return c
}

// Requirement 1: a consumer with RBAC gets a token through the exec plugin,
// and cluster-inventory-api's access package builds a working spoke client.
func TestConsumerUsesSpokeThroughPlugin(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	c := newConsumer(t, "credbroker", spoke.Name)
	ns := optIn(t, spoke, "reader", c.username())
	require.NoError(t, spoke.Grant(ctx, "", framework.ServiceAccountSubject(ns, "reader"), []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"namespaces"}, Verbs: []string{"list"}},
	}))

	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(c.token), 0o600))
	providers := access.Config{Providers: []access.Provider{{
		Name: plugin.Name,
		ExecConfig: &clientcmdapi.ExecConfig{
			APIVersion: "client.authentication.k8s.io/v1",
			Command:    pluginBin,
			Args: []string{
				"--broker-address", deployment.Broker.ExchangeAddr(),
				"--ca-file", deployment.CAFile,
				"--token-file", tokenFile,
			},
			ProvideClusterInfo: true,
		},
	}}}
	providerFile := filepath.Join(dir, "providers.json")
	b, err := json.Marshal(providers)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(providerFile, b, 0o600))

	loaded, err := access.NewFromFile(providerFile)
	require.NoError(t, err)
	cp, err := deployment.ClusterProfile(ctx, spoke)
	require.NoError(t, err)
	restConfig, err := loaded.BuildConfigFromCP(cp)
	require.NoError(t, err)
	client, err := kubernetes.NewForConfig(restConfig)
	require.NoError(t, err)

	nsList, err := client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	assert.NotEmpty(t, nsList.Items)

	self, err := client.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	require.NoError(t, err)
	assert.Equal(t, "system:serviceaccount:"+ns+":reader", self.Status.UserInfo.Username)
}

// Requirement 2: the token expires when it says, and dies with its
// ServiceAccount.
func TestTokenLifetime(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	c := newConsumer(t, "credbroker", spoke.Name)
	ns := optIn(t, spoke, "short-lived", c.username())

	before := time.Now()
	resp, err := exchange(t, c, &pb.ExchangeRequest{Cluster: clusterRef(spoke), ExpirationSeconds: 600})
	require.NoError(t, err)
	exp := resp.GetExpirationTime().AsTime()
	assert.Equal(t, claims(t, resp.GetToken()).Exp, exp.Unix(), "expiration_time is the token's exp claim")
	assert.WithinRange(t, exp, before.Add(600*time.Second).Add(-time.Second), time.Now().Add(600*time.Second).Add(time.Second))
	assert.Equal(t, "short-lived", resp.GetServiceAccount().GetName())
	assert.Equal(t, spoke.Server, resp.GetServer())
	assert.Equal(t, spoke.CAData, resp.GetCertificateAuthorityData())

	review, err := spoke.ReviewToken(ctx, resp.GetToken(), nil)
	require.NoError(t, err)
	require.True(t, review.Authenticated, review.Error)

	require.NoError(t, spoke.Client.CoreV1().ServiceAccounts(ns).Delete(ctx, "short-lived", metav1.DeleteOptions{}))
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		review, err := spoke.ReviewToken(ctx, resp.GetToken(), nil)
		if assert.NoError(c, err, "TokenReview on %s", spoke.Name) {
			assert.False(c, review.Authenticated, "the token of the deleted ServiceAccount is authenticated as %s", review.User.Username)
		}
	}, 30*time.Second, 100*time.Millisecond, "the spoke still accepts a token of a deleted ServiceAccount")
}

// Requirement 3: each refusal has its own code and an actionable message.
func TestRefusals(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	// A ClusterProfile whose agent never connects. It has a server: one
	// without is refused before the agent is asked.
	noAgent := uniqueName(t, "no-agent")
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, noAgent, spoke.Access(plugin.Name, nil))
	require.NoError(t, err)

	granted := newConsumer(t, "credbroker", spoke.Name, noAgent, "missing")
	optIn(t, spoke, "granted-sa", granted.username())
	notOptedIn := optIn(t, spoke, "closed-sa")
	// Without hub RBAC the answer is the same whether the ClusterProfile
	// exists or not: authorization comes before the lookup.
	noRBAC := newConsumer(t, "credbroker")
	rbacDenied := func(name string) string {
		return `hub RBAC does not allow "` + noRBAC.username() + `" to create clusterprofiles.multicluster.x-k8s.io/token "` +
			name + `" in namespace "` + framework.FleetNamespace + `"`
	}

	tests := []struct {
		name     string
		consumer consumer
		req      *pb.ExchangeRequest
		wantCode codes.Code
		wantMsg  string
	}{
		{
			name:     "no hub RBAC",
			consumer: noRBAC,
			req:      &pb.ExchangeRequest{Cluster: clusterRef(spoke)},
			wantCode: codes.PermissionDenied,
			wantMsg:  rbacDenied(spoke.Name),
		},
		{
			name:     "no hub RBAC, unknown ClusterProfile",
			consumer: noRBAC,
			req:      &pb.ExchangeRequest{Cluster: &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: "missing"}},
			wantCode: codes.PermissionDenied,
			wantMsg:  rbacDenied("missing"),
		},
		{
			name:     "hub token for the API server's default audience",
			consumer: newConsumer(t, "", spoke.Name),
			req:      &pb.ExchangeRequest{Cluster: clusterRef(spoke)},
			wantCode: codes.Unauthenticated,
			wantMsg:  `the token is not for audience "credbroker"`,
		},
		{
			name:     "spoke ServiceAccount not opted in",
			consumer: granted,
			req:      &pb.ExchangeRequest{Cluster: clusterRef(spoke), ServiceAccount: &pb.ObjectReference{Namespace: notOptedIn, Name: "closed-sa"}},
			wantCode: codes.PermissionDenied,
			wantMsg:  "credbroker.io/allowed-subjects",
		},
		{
			name:     "unknown ClusterProfile",
			consumer: granted,
			req:      &pb.ExchangeRequest{Cluster: &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: "missing"}},
			wantCode: codes.NotFound,
			wantMsg:  "fleet/missing",
		},
		{
			name:     "cluster without an agent",
			consumer: granted,
			req:      &pb.ExchangeRequest{Cluster: &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: noAgent}},
			wantCode: codes.Unavailable,
			wantMsg:  "no agent is connected for cluster fleet/" + noAgent,
		},
		{
			name:     "the broker's own audience",
			consumer: granted,
			req:      &pb.ExchangeRequest{Cluster: clusterRef(spoke), Audiences: []string{"credbroker"}},
			wantCode: codes.InvalidArgument,
			wantMsg:  "is the broker's own audience",
		},
		{
			name:     "malformed request",
			consumer: granted,
			req:      &pb.ExchangeRequest{Cluster: &pb.ObjectReference{Namespace: "Fleet", Name: spoke.Name}},
			wantCode: codes.InvalidArgument,
			wantMsg:  `cluster.namespace "Fleet"`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			start := time.Now()
			_, err := exchange(t, tt.consumer, tt.req)
			st := status.Convert(err)
			assert.Equal(t, tt.wantCode, st.Code(), st.Message())
			assert.Contains(t, st.Message(), tt.wantMsg)
			// Refusals never wait for the mint timeout.
			assert.Less(t, time.Since(start), mintTimeout)
		})
	}
}

// Requirement 5: the minted token's audience is exactly what was asked for
// (and the spoke ServiceAccount allows), or the spoke's default; never the
// broker's; and the hub refuses it.
func TestAudiences(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[1]
	c := newConsumer(t, "credbroker", spoke.Name)
	optInAudiences(t, spoke, "aud-sa", []string{"https://vault.example", "argocd"}, c.username())

	tests := []struct {
		name      string
		audiences []string
		want      []string
	}{
		{name: "requested", audiences: []string{"https://vault.example", "argocd"}, want: []string{"argocd", "https://vault.example"}},
		{name: "spoke default", want: []string{framework.IssuerFor(spoke.Name)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp, err := exchange(t, c, &pb.ExchangeRequest{Cluster: clusterRef(spoke), Audiences: tt.audiences})
			require.NoError(t, err)
			aud := claims(t, resp.GetToken()).Aud
			assert.ElementsMatch(t, tt.want, aud)
			assert.NotContains(t, aud, "credbroker")

			for _, audiences := range [][]string{nil, {"credbroker"}, tt.want} {
				review, err := env.Hub.ReviewToken(ctx, resp.GetToken(), audiences)
				require.NoError(t, err)
				assert.False(t, review.Authenticated, "the hub accepted a spoke token for audiences %v", audiences)
			}
			review, err := spoke.ReviewToken(ctx, resp.GetToken(), tt.want)
			require.NoError(t, err)
			assert.True(t, review.Authenticated, review.Error)
		})
	}
}

// The second exchange for the same key is served from the cache.
func TestCachedExchange(t *testing.T) {
	spoke := env.Spokes[1]
	c := newConsumer(t, "credbroker", spoke.Name)
	optInAudiences(t, spoke, "cached-sa", []string{"cache-test"}, c.username())
	req := &pb.ExchangeRequest{Cluster: clusterRef(spoke), Audiences: []string{"cache-test"}}
	first, err := exchange(t, c, req)
	require.NoError(t, err)
	second, err := exchange(t, c, req)
	require.NoError(t, err)
	assert.Equal(t, first.GetCredentialId(), second.GetCredentialId())
	assert.Contains(t, logs.String(), `"credentialID"="`+first.GetCredentialId()+`"`)
}

// Every broker replica holds a stream from every agent, so any replica
// serves any exchange, each with a cache of its own.
func TestEveryReplicaServes(t *testing.T) {
	spoke := env.Spokes[1]
	c := newConsumer(t, "credbroker", spoke.Name)
	optIn(t, spoke, "replica-sa", c.username())
	require.Len(t, deployment.Brokers, 2)
	var ids []string
	for _, b := range deployment.Brokers {
		assert.Equal(t, 1, b.Connected(framework.FleetNamespace, spoke.Name))
		resp, err := exchangeVia(t, exchangeClientAt(t, b.ExchangeAddr()), c, &pb.ExchangeRequest{Cluster: clusterRef(spoke)})
		require.NoError(t, err)
		ids = append(ids, resp.GetCredentialId())
	}
	assert.NotEqual(t, ids[0], ids[1], "replicas share no cache")
}
