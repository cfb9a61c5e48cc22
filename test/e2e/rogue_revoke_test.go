package e2e

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/credbroker/credbroker/pkg/identity"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// rogueStreamsPerBroker is how many streams the holder of spoke-1's SVID
// opens to each broker replica, each as another agent instance: with one
// stream of the honest agent beside them, a revoke sent to one stream of
// the cluster reaches a rogue one 16 times in 17.
const rogueStreamsPerBroker = 16

// swallowRevokes connects streams with the SVID of spoke's agent, and no
// spoke credential, to every broker replica, as rogueStreamsPerBroker agent
// instances. They answer every revoke with every id it names ("all gone")
// and every mint with an error. It returns the count of revokes they
// answered. The streams end, and the brokers drop them, when the test ends.
func swallowRevokes(t *testing.T, spoke *framework.Cluster) *atomic.Int32 {
	t.Helper()
	certPEM, keyPEM, err := deployment.CA.IssueSVID(framework.AgentID(spoke.Name), time.Hour)
	require.NoError(t, err)
	svid, err := x509svid.Parse(certPEM, keyPEM)
	require.NoError(t, err)
	bundle, err := x509bundle.Parse(deployment.CA.TrustDomain(), deployment.CA.BundlePEM())
	require.NoError(t, err)
	creds := identity.ClientCredentials(svid, bundle, spiffeid.RequireFromPath(deployment.CA.TrustDomain(), "/broker"))

	var answered atomic.Int32
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	honest := make([]int, len(deployment.Brokers))
	for i, b := range deployment.Brokers {
		honest[i] = b.Connected(framework.FleetNamespace, spoke.Name)
	}
	t.Cleanup(func() {
		cancel()
		wg.Wait()
		for i, b := range deployment.Brokers {
			require.EventuallyWithT(t, func(ct *assert.CollectT) {
				assert.Equal(ct, honest[i], b.Connected(framework.FleetNamespace, spoke.Name), "agent streams of %s", spoke.Name)
			},
				10*time.Second, 20*time.Millisecond, "a broker still holds a rogue stream")
		}
	})
	for i, b := range deployment.Brokers {
		conn, err := grpc.NewClient(b.AgentAddr(), grpc.WithTransportCredentials(creds))
		require.NoError(t, err)
		t.Cleanup(func() { _ = conn.Close() })
		client := pb.NewAgentTunnelClient(conn)
		for n := range rogueStreamsPerBroker {
			sctx := metadata.AppendToOutgoingContext(ctx, "credbroker-agent-instance", fmt.Sprintf("rogue-%d-%d", i, n))
			stream, err := framework.AdmitFakeAgent(sctx, client, "rogue")
			require.NoError(t, err)
			wg.Go(func() {
				for {
					f, err := stream.Recv()
					if err != nil {
						return
					}
					out := &pb.AgentFrame{CorrelationId: f.GetCorrelationId()}
					switch {
					case f.GetRevokeRequest() != nil:
						answered.Add(1)
						out.Body = &pb.AgentFrame_RevokeResponse{RevokeResponse: &pb.RevokeResponse{
							CredentialIds: f.GetRevokeRequest().GetCredentialIds()}}
					case f.GetMintRequest() != nil:
						out.Body = &pb.AgentFrame_Error{Error: &pb.Error{Code: int32(codes.Unavailable), Message: "rogue"}}
					default:
						continue
					}
					if stream.Send(out) != nil {
						return
					}
				}
			})
		}
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			assert.Equal(ct, honest[i]+rogueStreamsPerBroker, b.Connected(framework.FleetNamespace, spoke.Name), "replica %d's agent streams of %s", i, spoke.Name)
		}, 10*time.Second, 20*time.Millisecond, "the rogue streams to connect")
	}
	return &answered
}

// The attack: the holder of spoke-1's agent SVID, without any spoke
// credential, opens streams beside the honest agent's and answers every
// revoke "all gone". Had the broker sent each revoke down one stream, it
// would have reported the revoke done while the grant, and its token, lived
// on. The broker sends each revoke to every agent instance of the cluster,
// so the honest agent deletes the grant, and the spoke refuses the token
// within 20 s: after an explicit revoke through the Grants service, and
// after hub RBAC is withdrawn.
func TestRogueStreamsCannotSwallowRevokes(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	owner := newConsumer(t, "credbroker", spoke.Name)
	withdrawn := newConsumer(t, "credbroker", spoke.Name)
	ns := optIn(t, spoke, "swallowed", owner.username(), withdrawn.username())
	// The tokens are minted before the rogue streams connect, which would
	// answer the mints with an error.
	resp := mintOn(t, spoke, spoke.Name, owner, ns, "swallowed")
	withdrawnTok := mintOn(t, spoke, spoke.Name, withdrawn, ns, "swallowed").GetToken()
	id := resp.GetCredentialId()
	client := grantsClient(t)
	framework.Eventually(t, 10*time.Second, 50*time.Millisecond, "the owner to see its grant", func(c assert.TestingT) {
		assert.Contains(c, listGrants(t, client, owner, &pb.GrantSelector{Cluster: clusterRef(spoke)}), id, "the grants the owner lists")
	})

	answered := swallowRevokes(t, spoke)
	t.Run("explicit revoke", func(t *testing.T) {
		before := answered.Load()
		revoked, err := revokeGrants(owner, client, &pb.GrantSelector{CredentialId: id}, "the token leaked")
		require.NoError(t, err)
		revokedAt := time.Now()
		assert.Greater(t, answered.Load(), before, "no revoke reached a rogue stream")
		t.Logf("rogue streams answered %d revokes; revoked %d, pending %d", answered.Load()-before, len(revoked.GetRevoked()), len(revoked.GetPending()))
		refusedAfter(t, spoke, resp.GetToken(), revokedAt, "a revoke that rogue streams answered")
	})
	t.Run("hub RBAC withdrawn", func(t *testing.T) {
		before := answered.Load()
		bindings, err := env.Hub.Client.RbacV1().RoleBindings(framework.FleetNamespace).List(ctx, metav1.ListOptions{})
		require.NoError(t, err)
		i := slices.IndexFunc(bindings.Items, func(b rbacv1.RoleBinding) bool {
			return slices.Contains(b.Subjects, framework.ServiceAccountSubject(withdrawn.namespace, withdrawn.name))
		})
		require.GreaterOrEqual(t, i, 0, "no RoleBinding lets %s use %s", withdrawn.username(), spoke.Name)
		require.NoError(t, env.Hub.Client.RbacV1().RoleBindings(framework.FleetNamespace).Delete(ctx, bindings.Items[i].Name, metav1.DeleteOptions{}))
		withdrawnAt := time.Now()
		refusedAfter(t, spoke, withdrawnTok, withdrawnAt, "hub RBAC was withdrawn while rogue streams answered revokes")
		assert.Greater(t, answered.Load(), before, "no revoke reached a rogue stream")
	})
}
