package binaries

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/timestamppb"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/credbroker/credbroker/pkg/grants"
	"github.com/credbroker/credbroker/pkg/identity"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// A revoke that no agent confirms is recorded on the hub, as deploy/hub
// lets the broker, before the broker answers that it is pending; when the
// agent comes back, the broker sends it again, and once the agent confirms,
// the record is gone. The agent is a hand-written one over real mTLS, whose
// ClusterProfile has no other.
func TestPendingRevokeRecordedOnHub(t *testing.T) {
	ctx := t.Context()
	profile := unique("pending")
	cp, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, profile, deployment.ProfileAccess(spoke, framework.FleetNamespace, profile))
	require.NoError(t, err)
	c := newConsumer(t, profile)
	sa, err := env.Hub.Client.CoreV1().ServiceAccounts(c.Namespace).Get(ctx, c.Name, metav1.GetOptions{})
	require.NoError(t, err)
	grant := &pb.Grant{
		CredentialId: "JTI=" + unique("pending-revoke"),
		Cluster:      clusterRef(profile), ClusterUid: string(cp.UID),
		Subject:        &pb.Subject{Username: c.Username(), Uid: string(sa.UID)},
		ExpirationTime: timestamppb.New(time.Now().Add(30 * time.Minute)),
	}

	certPEM, keyPEM, err := deployment.CA.IssueSVID(framework.AgentID(profile), time.Hour)
	require.NoError(t, err)
	svid, err := x509svid.Parse(certPEM, keyPEM)
	require.NoError(t, err)
	bundle, err := x509bundle.Parse(deployment.CA.TrustDomain(), deployment.CA.BundlePEM())
	require.NoError(t, err)
	conn, err := grpc.NewClient(brokerAgentAddr, grpc.WithTransportCredentials(
		identity.ClientCredentials(svid, bundle, spiffeid.RequireFromPath(deployment.CA.TrustDomain(), "/broker"))))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	tunnel := pb.NewAgentTunnelClient(conn)
	// connect admits the fake agent and returns its stream, which ends with
	// the returned cancel.
	connect := func() (grpc.BidiStreamingClient[pb.AgentFrame, pb.BrokerFrame], context.CancelFunc) {
		var (
			stream grpc.BidiStreamingClient[pb.AgentFrame, pb.BrokerFrame]
			cancel context.CancelFunc
		)
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			var sctx context.Context
			sctx, cancel = context.WithCancel(ctx)
			if stream, err = framework.AdmitFakeAgent(sctx, tunnel, "pending-revoke-test"); err != nil {
				cancel()
			}
			assert.NoError(ct, err, "admitting the fake agent")
		}, 30*time.Second, 100*time.Millisecond, "the broker did not admit the fake agent")
		return stream, cancel
	}

	// The agent reports the grant, then goes away.
	stream, cancel := connect()
	require.NoError(t, stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_GrantUpdate{GrantUpdate: &pb.GrantUpdate{Added: []*pb.Grant{grant}}}}))
	_, grantsConn := exchangeClient(t)
	client := pb.NewGrantsClient(grantsConn)
	selector := &pb.GrantSelector{CredentialId: grant.GetCredentialId()}
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		list, err := client.List(c.Context(ctx), &pb.ListGrantsRequest{Selector: selector})
		if assert.NoError(ct, err, "ListGrants") {
			assert.Len(ct, list.GetGrants(), 1, "the grants of %s", grant.GetCredentialId())
		}
	}, 30*time.Second, 50*time.Millisecond, "the broker did not take the fake agent's grant")
	cancel()

	// The revoke finds no agent: it is recorded, then answered pending.
	var answer *pb.RevokeGrantsResponse
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		answer, err = client.Revoke(c.Context(ctx), &pb.RevokeGrantsRequest{Selector: selector, Reason: "binaries: pending"})
		if assert.NoError(ct, err, "Revoke") {
			assert.Len(ct, answer.GetPending(), 1, "the revoke's pending grants (answer: %v)", answer)
		}
	}, 30*time.Second, 100*time.Millisecond, "the revoke was not answered pending")
	require.Empty(t, answer.GetRevoked())
	var pendingData map[string]string // the record that recorded read last
	recorded := func() bool {
		cm, err := env.Hub.Client.CoreV1().ConfigMaps(brokerAccount.Namespace).Get(ctx, grants.DefaultPendingConfigMap, metav1.GetOptions{})
		if err == nil {
			pendingData = cm.Data
		}
		return err == nil && slices.ContainsFunc(valuesOf(cm.Data), func(v string) bool { return strings.Contains(v, grant.GetCredentialId()) })
	}
	require.True(t, recorded(), "the pending revoke is not recorded on the hub")

	// The agent comes back: the broker sends the revoke again at its hello,
	// the agent confirms it, and the record goes.
	stream, cancel = connect()
	defer cancel()
	for {
		f, err := stream.Recv()
		require.NoError(t, err)
		req := f.GetRevokeRequest()
		if req == nil || !slices.Contains(req.GetCredentialIds(), grant.GetCredentialId()) {
			continue
		}
		require.NoError(t, stream.Send(&pb.AgentFrame{CorrelationId: f.GetCorrelationId(),
			Body: &pb.AgentFrame_RevokeResponse{RevokeResponse: &pb.RevokeResponse{CredentialIds: req.GetCredentialIds()}}}))
		break
	}
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		assert.False(ct, recorded(), "%s records %s: %v", grants.DefaultPendingConfigMap, grant.GetCredentialId(), pendingData)
	}, 30*time.Second, 50*time.Millisecond, "the confirmed revoke stays recorded on the hub")
}

func valuesOf(m map[string]string) []string {
	out := make([]string, 0, len(m))
	for _, v := range m {
		out = append(out, v)
	}
	return out
}
