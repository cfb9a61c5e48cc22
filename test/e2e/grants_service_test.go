package e2e

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"
	rbacv1 "k8s.io/api/rbac/v1"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// grantsClient dials the first broker's exchange port, which also serves
// Grants, verifying it with the deployment's CA.
func grantsClient(t *testing.T) pb.GrantsClient {
	t.Helper()
	pem, err := os.ReadFile(deployment.CAFile)
	require.NoError(t, err)
	pool := x509.NewCertPool()
	require.True(t, pool.AppendCertsFromPEM(pem))
	conn, err := grpc.NewClient(deployment.Broker.ExchangeAddr(),
		grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12})))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return pb.NewGrantsClient(conn)
}

func listGrants(t *testing.T, client pb.GrantsClient, c consumer, sel *pb.GrantSelector) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(bearer(c.token), 10*time.Second)
	defer cancel()
	resp, err := client.List(ctx, &pb.ListGrantsRequest{Selector: sel})
	require.NoError(t, err)
	var ids []string
	for _, g := range resp.GetGrants() {
		ids = append(ids, g.GetCredentialId())
	}
	return ids
}

func revokeGrants(c consumer, client pb.GrantsClient, sel *pb.GrantSelector, reason string) (*pb.RevokeGrantsResponse, error) {
	ctx, cancel := context.WithTimeout(bearer(c.token), 30*time.Second)
	defer cancel()
	return client.Revoke(ctx, &pb.RevokeGrantsRequest{Selector: sel, Reason: reason})
}

// A consumer sees its own grant; another consumer without hub RBAC can
// neither see nor revoke it (the attack); with delete on
// clusterprofiles/token of its ClusterProfile it can, and the spoke then
// refuses the token.
func TestGrantsServiceListAndRevoke(t *testing.T) {
	ctx := context.Background()
	cluster := env.Spokes[0]
	owner := newConsumer(t, "credbroker", cluster.Name)
	ns := optIn(t, cluster, "revocable", owner.username())
	resp, err := exchange(t, owner, &pb.ExchangeRequest{Cluster: clusterRef(cluster)})
	require.NoError(t, err)
	id := resp.GetCredentialId()
	require.Regexp(t, `^JTI=`, id)
	err = selfReview(t, cluster, resp.GetToken())
	require.NoError(t, err)

	client := grantsClient(t)
	byID := &pb.GrantSelector{CredentialId: id}
	// The agent reports the grant to the broker on its own time.
	framework.Eventually(t, 10*time.Second, 50*time.Millisecond, "the owner to see its grant", func(c assert.TestingT) {
		assert.Contains(c, listGrants(t, client, owner, &pb.GrantSelector{Cluster: clusterRef(cluster)}), id, "the grants the owner lists")
	})

	other := newConsumer(t, "credbroker", cluster.Name) // may exchange, nothing more
	t.Run("another consumer without RBAC does not see the grant", func(t *testing.T) {
		assert.Empty(t, listGrants(t, client, other, byID))
		assert.NotContains(t, listGrants(t, client, other, nil), id)
	})
	t.Run("another consumer without RBAC cannot revoke the grant", func(t *testing.T) {
		_, err := revokeGrants(other, client, byID, "attack")
		require.Equal(t, codes.PermissionDenied, status.Code(err), "%v", err)
		// The answer does not tell where the grant lives, nor that it
		// exists: a credential id nobody holds gets the same.
		assert.NotContains(t, status.Convert(err).Message(), cluster.Name)
		_, absent := revokeGrants(other, client, &pb.GrantSelector{CredentialId: "JTI=no-such-token"}, "attack")
		require.Equal(t, codes.PermissionDenied, status.Code(absent), "%v", absent)
		_, err = revokeGrants(other, client, &pb.GrantSelector{Cluster: clusterRef(cluster)}, "attack")
		require.Equal(t, codes.PermissionDenied, status.Code(err), "%v", err)
		assert.Contains(t, status.Convert(err).Message(), fmt.Sprintf("%q in namespace %q", cluster.Name, framework.FleetNamespace))
		err = selfReview(t, cluster, resp.GetToken())
		require.NoError(t, err, "the spoke refuses a token nobody could revoke")
	})

	require.NoError(t, env.Hub.Grant(ctx, framework.FleetNamespace, framework.ServiceAccountSubject(other.namespace, other.name),
		[]rbacv1.PolicyRule{{
			APIGroups:     []string{"multicluster.x-k8s.io"},
			Resources:     []string{"clusterprofiles/token"},
			Verbs:         []string{"delete"},
			ResourceNames: []string{cluster.Name},
		}}))
	// The broker keeps the hub's denial above for its DenyTTL (2s), as
	// the exchange does: the new RBAC applies once it has passed.
	var revoked *pb.RevokeGrantsResponse
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		revoked, err = revokeGrants(other, client, byID, "offboarded")
		assert.NotEqual(ct, codes.PermissionDenied, status.Code(err), "the revoke: %v", err)
	}, 10*time.Second, 200*time.Millisecond, "the revoke is still refused after the RBAC grant")
	require.NoError(t, err)
	revokedAt := time.Now()
	require.Len(t, revoked.GetRevoked(), 1, "pending: %v", revoked.GetPending())
	assert.Equal(t, id, revoked.GetRevoked()[0].GetCredentialId())
	assert.Equal(t, owner.username(), revoked.GetRevoked()[0].GetSubject().GetUsername())
	assert.Equal(t, ns, revoked.GetRevoked()[0].GetServiceAccount().GetNamespace())

	refusedAfter(t, cluster, resp.GetToken(), revokedAt, "the Grants service revoked it")

	assert.NotContains(t, listGrants(t, client, owner, nil), id)
	logLine(t, `"msg"="grants"`, `"method"="revoke"`, `"user"="`+other.username()+`"`, `"revoked"=["`+id+`"]`, `"code"="OK"`)
	logLine(t, `"msg"="grants"`, `"method"="revoke"`, `"user"="`+other.username()+`"`, `"code"="PermissionDenied"`)
}

// Revoke refuses an empty selector, and says so when nothing matches to a
// caller who may revoke others' grants; one who may not is told only that.
func TestGrantsServiceRevokeArguments(t *testing.T) {
	c := newConsumer(t, "credbroker")
	client := grantsClient(t)
	_, err := revokeGrants(c, client, nil, "")
	assert.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
	_, err = revokeGrants(c, client, &pb.GrantSelector{CredentialId: "JTI=no-such-token"}, "")
	assert.Equal(t, codes.PermissionDenied, status.Code(err), "%v", err)
	admin := newConsumer(t, "credbroker")
	require.NoError(t, env.Hub.Grant(context.Background(), framework.FleetNamespace, framework.ServiceAccountSubject(admin.namespace, admin.name),
		[]rbacv1.PolicyRule{{APIGroups: []string{"multicluster.x-k8s.io"}, Resources: []string{"clusterprofiles/token"}, Verbs: []string{"delete"}}}))
	_, err = revokeGrants(admin, client, &pb.GrantSelector{Cluster: clusterRef(env.Spokes[0]), CredentialId: "JTI=no-such-token"}, "")
	assert.Equal(t, codes.NotFound, status.Code(err), "%v", err)
	_, err = revokeGrants(consumer{token: "not-a-token"}, client, &pb.GrantSelector{Username: c.username()}, "")
	assert.Equal(t, codes.Unauthenticated, status.Code(err), "%v", err)
}
