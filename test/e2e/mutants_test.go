package e2e

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	rbacv1 "k8s.io/api/rbac/v1"

	spokepkg "github.com/credbroker/credbroker/pkg/spoke"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// The tests of this file kill mutants that once left every test green:
// each fails when the check it names is edited out of the broker.

// Mutant: the SubjectAccessReview carries only the username, not the
// consumer's groups, uid and extra. Then hub RBAC granted to a group never
// applies. Here the only grant is to the group of every ServiceAccount of
// the consumer's namespace, as an admin grants a whole team.
func TestGrantToAGroupOnly(t *testing.T) {
	ctx := context.Background()
	cluster := env.Spokes[0]
	member := newConsumer(t, "credbroker") // no grant of its own
	outsider := newConsumer(t, "credbroker")
	require.NoError(t, env.Hub.Grant(ctx, framework.FleetNamespace,
		rbacv1.Subject{Kind: rbacv1.GroupKind, Name: hubNamespaceGroup(member)},
		[]rbacv1.PolicyRule{framework.ClusterProfileTokenRule(cluster.Name)}))
	ns := optIn(t, cluster, "team-sa", member.username(), outsider.username())
	req := func() *pb.ExchangeRequest {
		return &pb.ExchangeRequest{Cluster: clusterRef(cluster), ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: "team-sa"}}
	}

	resp, err := exchange(t, member, req())
	require.NoError(t, err, "a member of the granted group is refused")
	require.NoError(t, selfReview(t, cluster, resp.GetToken()))

	// The grant is what let the member in: the same request from outside
	// the group is refused by hub RBAC.
	_, err = exchange(t, outsider, req())
	require.Equal(t, codes.PermissionDenied, status.Code(err), "err: %v", err)
	assert.Contains(t, status.Convert(err).Message(), "hub RBAC does not allow")
}

// Mutant: the consumer is left out of the token cache key. Then a second
// consumer asking for the same cluster, ServiceAccount and audiences gets
// the first one's cached token: the spoke's grant and audit name the
// wrong consumer, and revoking one leaves the other holding the token.
// Both consumers are made here, so the result does not depend on which
// tests ran before.
func TestSecondConsumerGetsATokenOfItsOwn(t *testing.T) {
	ctx := context.Background()
	cluster := env.Spokes[1]
	first := newConsumer(t, "credbroker", cluster.Name)
	second := newConsumer(t, "credbroker", cluster.Name)
	ns := optIn(t, cluster, "shared-sa", first.username(), second.username())
	// Both exchanges go to the same replica, whose cache the first fills.
	client := exchangeClient(t)
	req := func() *pb.ExchangeRequest {
		return &pb.ExchangeRequest{Cluster: clusterRef(cluster), ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: "shared-sa"}}
	}

	got := map[string]*pb.ExchangeResponse{}
	for _, c := range []consumer{first, second} {
		resp, err := exchangeVia(t, client, c, req())
		require.NoError(t, err)
		got[c.username()] = resp
	}
	a, b := got[first.username()], got[second.username()]
	assert.False(t, a.GetToken() == b.GetToken(), "the second consumer got the first one's token")
	assert.NotEqual(t, a.GetCredentialId(), b.GetCredentialId())

	// Each token's grant on the spoke names the consumer it went to.
	for user, resp := range got {
		jti, ok := strings.CutPrefix(resp.GetCredentialId(), "JTI=")
		require.True(t, ok, resp.GetCredentialId())
		grant := claimedGrant(ctx, t, cluster, jti)
		assert.Equal(t, user, grant.Annotations[spokepkg.GrantHubUserAnnotation])
	}

	// Each consumer still reuses its own token.
	again, err := exchangeVia(t, client, second, req())
	require.NoError(t, err)
	assert.Equal(t, b.GetCredentialId(), again.GetCredentialId())
}
