package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/apimachinery/pkg/types"

	"github.com/credbroker/credbroker/pkg/broker"
	"github.com/credbroker/credbroker/pkg/grants"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// The attack: a consumer's spoke token must be taken away before it
// expires (it leaked, or the consumer was let go). Revoking it through any
// broker replica's registry must make the spoke refuse it within 20 s, and
// no replica may hand the revoked token out again from its cache.
func TestRegistryRevokeRevokesIssuedToken(t *testing.T) {
	require.GreaterOrEqual(t, len(deployment.Brokers), 2, "the suite runs two broker replicas")
	cluster := env.Spokes[0]
	profile := types.NamespacedName{Namespace: framework.FleetNamespace, Name: cluster.Name}
	minter, other := deployment.Brokers[0], deployment.Brokers[1]

	tests := []struct {
		name string
		// revoker is the replica whose registry revokes.
		revoker *broker.Broker
	}{
		// It learnt of the grant from its own exchange, before any agent
		// reported it.
		{name: "through the replica that minted it", revoker: minter},
		// It learns of the grant from the agent's report only.
		{name: "through another replica", revoker: other},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			c := newConsumer(t, "credbroker", cluster.Name)
			ns := optIn(t, cluster, "revocable", c.username())
			client := exchangeClientAt(t, minter.ExchangeAddr())
			resp, err := exchangeVia(t, client, c, &pb.ExchangeRequest{Cluster: clusterRef(cluster)})
			require.NoError(t, err)
			id := resp.GetCredentialId()
			require.Regexp(t, `^JTI=`, id)
			require.NoError(t, selfReview(t, cluster, resp.GetToken()))

			// The replica that minted knows the grant at once.
			known := minter.Grants().Select(grants.Selector{CredentialID: id})
			require.Len(t, known, 1, "the minting replica does not know the grant it just minted")
			assert.Equal(t, c.username(), known[0].GetSubject().GetUsername())
			assert.Equal(t, profile.Name, known[0].GetCluster().GetName())
			assert.Equal(t, "revocable", known[0].GetServiceAccount().GetName())
			assert.Equal(t, ns, known[0].GetServiceAccount().GetNamespace())

			// Every replica learns it from the agent.
			var found []*pb.Grant
			require.EventuallyWithT(t, func(c *assert.CollectT) {
				found = tt.revoker.Grants().Select(grants.Selector{CredentialID: id})
				assert.Len(c, found, 1, "the revoking replica's grants of %s", id)
			}, 20*time.Second, 50*time.Millisecond, "the agent did not report grant %s to the replica", id)
			require.EventuallyWithT(t, func(c *assert.CollectT) {
				assert.Len(c, other.Grants().Select(grants.Selector{CredentialID: id}), 1, "the other replica's grants of %s", id)
			}, 20*time.Second, 50*time.Millisecond, "the agent did not report grant %s to the other replica", id)

			start := time.Now()
			revoked, pending := tt.revoker.Grants().Revoke(ctx, found, "e2e: the token leaked")
			require.Len(t, revoked, 1, "pending: %v", pending)
			assert.Empty(t, pending)
			assert.Equal(t, id, revoked[0].GetCredentialId())
			assert.True(t, tt.revoker.Grants().Revoked(id))
			refusedAfter(t, cluster, resp.GetToken(), start, "the registry revoked it")

			// Every replica learns of the revoke, and none hands the token
			// out again: the minting replica's cache still holds it.
			for i, b := range deployment.Brokers {
				require.EventuallyWithT(t, func(c *assert.CollectT) { assertRevoked(c, i, b, id) }, 20*time.Second, 50*time.Millisecond,
					"replica %d does not know grant %s was revoked", i, id)
				assert.Empty(t, b.Grants().Select(grants.Selector{CredentialID: id}), "replica %d lists a revoked grant", i)
			}
			again, err := exchangeVia(t, client, c, &pb.ExchangeRequest{Cluster: clusterRef(cluster)})
			require.NoError(t, err)
			assert.NotEqual(t, id, again.GetCredentialId(), "the broker handed out a revoked token from its cache")
			assert.NotEqual(t, resp.GetToken(), again.GetToken(), "the broker handed out a revoked token from its cache")
			require.NoError(t, selfReview(t, cluster, again.GetToken()), "the token minted in place of the revoked one does not work")
			assert.Contains(t, logLine(t, `"msg"="exchange"`, `"credentialID"="`+again.GetCredentialId()+`"`), `"cacheHit"=false`)
		})
	}
}

// The agent answers a revoke of a grant it does not hold with the id as
// gone, and a revoke of a cluster without an agent stays pending.
func TestRegistryRevokeOfUnknownAndUnreachableGrants(t *testing.T) {
	ctx := context.Background()
	cluster := env.Spokes[0]
	reg := deployment.Broker.Grants()
	cp, err := deployment.ClusterProfile(ctx, cluster)
	require.NoError(t, err)
	exp := time.Now().Add(time.Hour)
	gone := &pb.Grant{
		CredentialId: "JTI=00000000-0000-0000-0000-000000000000",
		Cluster:      clusterRef(cluster), ClusterUid: string(cp.UID),
		ExpirationTime: timestamppb.New(exp),
	}
	unreachable := &pb.Grant{
		CredentialId: "JTI=11111111-1111-1111-1111-111111111111",
		Cluster:      &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: "no-such-cluster"}, ClusterUid: "no-uid",
		ExpirationTime: timestamppb.New(exp),
	}
	revoked, pending := reg.Revoke(ctx, []*pb.Grant{gone, unreachable}, "e2e")
	require.Len(t, revoked, 1)
	assert.Equal(t, gone.GetCredentialId(), revoked[0].GetCredentialId())
	require.Len(t, pending, 1)
	assert.Equal(t, unreachable.GetCredentialId(), pending[0].GetCredentialId())
	assert.True(t, reg.Revoked(unreachable.GetCredentialId()), "a pending revoke counts as revoked")
}
