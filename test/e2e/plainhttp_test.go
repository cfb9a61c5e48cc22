package e2e

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	authenticationv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	clientauthenticationv1 "k8s.io/client-go/pkg/apis/clientauthentication/v1"
	"sigs.k8s.io/cluster-inventory-api/pkg/access"

	"github.com/credbroker/credbroker/pkg/plugin"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// A ClusterProfile whose server is plain http, by mistake or from a status
// writer, would have client-go send the spoke token in cleartext, to anyone
// on the path or listening on that address. The broker refuses it before
// any mint (FailedPrecondition, naming the server and the access provider,
// as for a profile without a server), and the plugin refuses it before it
// asks for a token; the listener never sees a request.
func TestPlainHTTPServerGetsNoToken(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	var requests, bearers atomic.Int32
	listener := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		if r.Header.Get("Authorization") != "" {
			bearers.Add(1)
		}
		w.WriteHeader(http.StatusForbidden)
	}))
	t.Cleanup(listener.Close)

	name := uniqueName(t, "plain-http")
	ext, err := json.Marshal(plugin.ExecConfig{ClusterProfile: &plugin.Reference{Namespace: framework.FleetNamespace, Name: name}})
	require.NoError(t, err)
	cp, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name,
		&framework.Access{ProviderName: plugin.Name, Server: listener.URL, CAData: spoke.CAData, ExecConfig: ext})
	require.NoError(t, err)
	// An agent on spoke that serves that ClusterProfile, so that without the
	// check the exchange would mint.
	stop, err := deployment.StartAgent(ctx, spoke, framework.AgentID(name))
	require.NoError(t, err)
	t.Cleanup(stop)

	c := newConsumer(t, "credbroker", name)
	ns := optIn(t, spoke, "plain", c.username())
	minted := `"msg"="minted spoke token" "spoke"="` + spoke.Name + `" "subject"="` + c.username() + `" "serviceAccount"="` + ns + `/plain"`

	t.Run("the broker refuses the exchange", func(t *testing.T) {
		_, err := exchange(t, c, &pb.ExchangeRequest{Cluster: &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: name}})
		st := status.Convert(err)
		assert.Equal(t, codes.FailedPrecondition, st.Code(), st.Message())
		assert.Contains(t, st.Message(), "fleet/"+name)
		assert.Contains(t, st.Message(), listener.URL)
		assert.Contains(t, st.Message(), "https")
		assert.Contains(t, st.Message(), "accessProviders[name="+plugin.Name+"]")
	})

	t.Run("the plugin asks for no token", func(t *testing.T) {
		run := runPluginFor(t, c, clientauthenticationv1.Cluster{Server: listener.URL, CertificateAuthorityData: spoke.CAData}, name)
		assert.Equal(t, 1, run.code, "stderr: %s", run.stderr)
		assert.True(t, run.stdout == "", "no ExecCredential, and so no token, on stdout; got %d bytes", len(run.stdout))
		assert.Contains(t, run.stderr, listener.URL)
		assert.Contains(t, run.stderr, "not an https URL")
		assert.NotContains(t, run.stderr, c.token)
	})

	t.Run("a pkg/access client sends nothing", func(t *testing.T) {
		restConfig, err := accessConfig(t, c, access.ProfileSourcedCLIArgsPolicyIgnore).BuildConfigFromCP(cp)
		require.NoError(t, err)
		client, err := kubernetes.NewForConfig(restConfig)
		require.NoError(t, err)
		_, err = client.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
		require.Error(t, err)
	})

	assert.Zero(t, bearers.Load(), "the http listener received a token in cleartext")
	assert.Zero(t, requests.Load(), "a client sent the http listener a request")
	assert.False(t, strings.Contains(logs.String(), minted), "the agent minted a token for a ClusterProfile whose server is http")
}
