package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/credbroker/credbroker/internal/testing/testpki"
	"github.com/credbroker/credbroker/pkg/identity"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// connectAs opens an AgentTunnel stream to the broker with an SVID for id
// issued by ca, and returns how the broker answered the hello.
func connectAs(t *testing.T, ca *testpki.CA, id string) error {
	t.Helper()
	certPEM, keyPEM, err := ca.IssueSVID(id, time.Hour)
	require.NoError(t, err)
	svid, err := x509svid.Parse(certPEM, keyPEM)
	require.NoError(t, err)
	bundle, err := x509bundle.Parse(deployment.CA.TrustDomain(), deployment.CA.BundlePEM())
	require.NoError(t, err)
	brokerID := spiffeid.RequireFromPath(deployment.CA.TrustDomain(), "/broker")
	conn, err := grpc.NewClient(deployment.Broker.AgentAddr(), grpc.WithTransportCredentials(identity.ClientCredentials(svid, bundle, brokerID)))
	require.NoError(t, err)
	defer conn.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stream, err := pb.NewAgentTunnelClient(conn).Connect(ctx)
	if err != nil {
		return err
	}
	_ = stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_Hello{Hello: &pb.Hello{}}})
	if md, err := stream.Header(); err != nil || len(md.Get("credbroker-cluster")) == 0 {
		_, err = stream.Recv()
		return err
	}
	return nil
}

// Requirement 4: an agent serves only the ClusterProfile its SVID names, and
// only SVIDs of the broker's trust domain are accepted.
func TestAgentIdentity(t *testing.T) {
	ctx := context.Background()

	t.Run("an agent with the SVID of cluster A does not serve cluster B", func(t *testing.T) {
		before := deployment.Broker.Connected(framework.FleetNamespace, env.Spokes[0].Name)
		beforeHost := deployment.Broker.Connected(framework.FleetNamespace, env.Spokes[1].Name)
		// It holds no grant of its own; revoking its ClusterProfile's grants
		// when it stops would reach spoke-2, where spoke-1's grants are not,
		// and an agent answers a grant it cannot find as gone.
		stop, err := deployment.StartAgentWith(ctx, env.Spokes[1], framework.AgentOptions{
			ID: framework.AgentID(env.Spokes[0].Name), KeepGrants: true,
		})
		require.NoError(t, err)
		defer stop()
		assert.Equal(t, before+1, deployment.Broker.Connected(framework.FleetNamespace, env.Spokes[0].Name))
		// It runs on spoke-2 and advertises spoke-2's server, yet it serves
		// only the ClusterProfile its SVID names.
		assert.Equal(t, beforeHost, deployment.Broker.Connected(framework.FleetNamespace, env.Spokes[1].Name),
			"an agent with cluster A's SVID was counted for the cluster it runs on")
	})

	t.Run("an SVID that names no ClusterProfile is refused", func(t *testing.T) {
		err := connectAs(t, deployment.CA, framework.AgentID("ghost"))
		assert.Equal(t, codes.PermissionDenied, status.Code(err), err)
		assert.Contains(t, err.Error(), "no ClusterProfile accepts agent spiffe://"+framework.TrustDomain+"/clusterprofile/fleet/ghost")
	})

	t.Run("an SVID outside the ClusterProfile path is refused", func(t *testing.T) {
		err := connectAs(t, deployment.CA, "spiffe://"+framework.TrustDomain+"/broker")
		assert.Equal(t, codes.PermissionDenied, status.Code(err), err)
	})

	t.Run("a client certificate from another trust domain is refused", func(t *testing.T) {
		other, err := testpki.NewCA("other.test")
		require.NoError(t, err)
		err = connectAs(t, other, "spiffe://other.test/clusterprofile/fleet/"+env.Spokes[0].Name)
		assert.Equal(t, codes.Unavailable, status.Code(err), err)
	})

	t.Run("an SVID of the trust domain signed by another CA is refused", func(t *testing.T) {
		forger, err := testpki.NewCA(framework.TrustDomain)
		require.NoError(t, err)
		err = connectAs(t, forger, framework.AgentID(env.Spokes[0].Name))
		assert.Equal(t, codes.Unavailable, status.Code(err), err)
	})

	t.Run("deleting the ClusterProfile closes its streams", func(t *testing.T) {
		name := uniqueName(t, "short-lived")
		_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, nil)
		require.NoError(t, err)
		stop, err := deployment.StartAgent(ctx, env.Spokes[1], framework.AgentID(name))
		require.NoError(t, err)
		defer stop()
		require.Equal(t, 1, deployment.Broker.Connected(framework.FleetNamespace, name))
		require.NoError(t, env.Hub.Inventory.ApisV1alpha1().ClusterProfiles(framework.FleetNamespace).Delete(ctx, name, metav1.DeleteOptions{}))
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			assert.Zero(c, deployment.Broker.Connected(framework.FleetNamespace, name), "agent streams of %s", name)
		}, 10*time.Second, 20*time.Millisecond, "the broker to close the streams of the deleted ClusterProfile")
	})
}

// Requirement 6: the hub stores nothing of the spokes. After every exchange
// of the run so far (this test is last in its file order, and makes its
// own), no Secret or ConfigMap on the hub holds a minted token, and no log
// line of the broker or the agents contains one.
func TestHubStoresNoSpokeToken(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	c := newConsumer(t, "credbroker", spoke.Name)
	optInAudiences(t, spoke, "stored-sa", []string{"a", "b", "c"}, c.username())
	for _, aud := range []string{"a", "b", "c"} {
		_, err := exchange(t, c, &pb.ExchangeRequest{Cluster: clusterRef(spoke), Audiences: []string{aud}})
		require.NoError(t, err)
	}

	minted.Lock()
	tokens := append([]string(nil), minted.tokens...)
	minted.Unlock()
	require.NotEmpty(t, tokens)

	secrets, err := env.Hub.Client.CoreV1().Secrets("").List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	configMaps, err := env.Hub.Client.CoreV1().ConfigMaps("").List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	var stored []string
	for _, s := range secrets.Items {
		stored = append(stored, secretValues(s)...)
	}
	for _, cm := range configMaps.Items {
		for _, v := range cm.Data {
			stored = append(stored, v)
		}
		for _, v := range cm.BinaryData {
			stored = append(stored, string(v))
		}
	}
	allLogs := logs.String()
	for _, tok := range tokens {
		for _, v := range stored {
			assert.NotContains(t, v, tok, "a spoke token is stored on the hub")
		}
		assert.False(t, strings.Contains(allLogs, tok), "a spoke token reached a log")
	}
	assert.False(t, strings.Contains(allLogs, c.token), "a hub token reached a log")
}

func secretValues(s corev1.Secret) []string {
	var out []string
	for _, v := range s.Data {
		out = append(out, string(v))
	}
	for _, v := range s.StringData {
		out = append(out, v)
	}
	return out
}
