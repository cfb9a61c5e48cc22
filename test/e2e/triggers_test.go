package e2e

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	authenticationv1 "k8s.io/api/authentication/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// selfReview asks spoke who the token is, with the token.
func selfReview(t *testing.T, spoke *framework.Cluster, tok string) error {
	t.Helper()
	client, err := kubernetes.NewForConfig(spoke.TokenConfig(tok))
	require.NoError(t, err)
	_, err = client.AuthenticationV1().SelfSubjectReviews().Create(context.Background(), &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	return err
}

// mintOn exchanges c's hub token for a token of the spoke ServiceAccount
// ns/name through the ClusterProfile fleet/profile, and checks that the
// spoke accepts it.
func mintOn(t *testing.T, spoke *framework.Cluster, profile string, c consumer, ns, name string) *pb.ExchangeResponse {
	t.Helper()
	resp, err := exchange(t, c, &pb.ExchangeRequest{
		Cluster:        &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: profile},
		ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: name},
	})
	require.NoError(t, err)
	require.NoError(t, selfReview(t, spoke, resp.GetToken()), "the spoke refuses a fresh token")
	return resp
}

// refusedAfter polls the spoke with tok until it refuses it, and logs how
// long after the trigger fired at since.
func refusedAfter(t *testing.T, spoke *framework.Cluster, tok string, since time.Time, trigger string) {
	t.Helper()
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		err := selfReview(t, spoke, tok)
		assert.True(c, apierrors.IsUnauthorized(err), "a SelfSubjectReview with the token: want Unauthorized, got %v", err)
	}, 40*time.Second, 100*time.Millisecond, "the spoke still accepts a token after %s", trigger)
	lag := time.Since(since)
	t.Logf("revocation lag: the spoke refused the token %s after %s", lag.Round(100*time.Millisecond), trigger)
	assert.LessOrEqual(t, lag, 20*time.Second)
}

// withdrawRoleBinding deletes the hub RoleBinding that lets c use a
// ClusterProfile of the fleet namespace.
func withdrawRoleBinding(t *testing.T, c consumer) {
	t.Helper()
	ctx := t.Context()
	bindings, err := env.Hub.Client.RbacV1().RoleBindings(framework.FleetNamespace).List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	i := slices.IndexFunc(bindings.Items, func(b rbacv1.RoleBinding) bool {
		return slices.Contains(b.Subjects, framework.ServiceAccountSubject(c.namespace, c.name))
	})
	require.GreaterOrEqual(t, i, 0, "no RoleBinding lets %s use a ClusterProfile", c.username())
	require.NoError(t, env.Hub.Client.RbacV1().RoleBindings(framework.FleetNamespace).Delete(ctx, bindings.Items[i].Name, metav1.DeleteOptions{}))
}

// Trigger 1. The attack: hub RBAC no longer lets a consumer create
// clusterprofiles/token on a ClusterProfile, and the consumer goes on using
// the spoke tokens it already holds, for up to their lifetime. The spoke
// must refuse them, and only them.
func TestWithdrawnHubRBACRevokesIssuedTokens(t *testing.T) {
	spoke := env.Spokes[0]
	gone, stays := newConsumer(t, "credbroker", spoke.Name), newConsumer(t, "credbroker", spoke.Name)
	ns := optIn(t, spoke, "rbac-withdrawn", gone.username(), stays.username())
	goneTok := mintOn(t, spoke, spoke.Name, gone, ns, "rbac-withdrawn").GetToken()
	staysTok := mintOn(t, spoke, spoke.Name, stays, ns, "rbac-withdrawn").GetToken()

	withdrawRoleBinding(t, gone)
	withdrawn := time.Now()

	refusedAfter(t, spoke, goneTok, withdrawn, "hub RBAC withdrew the consumer's access")
	assert.NoError(t, selfReview(t, spoke, staysTok), "a consumer hub RBAC still allows lost its token")
	line := logLine(t, `"msg"="revoked grant"`, `"trigger"="rbac"`, `"subject"="`+gone.username()+`"`)
	assert.NotContains(t, line, goneTok)
}

// Trigger 2. The attack: a ClusterProfile is deleted, and the tokens minted
// through it stay valid on its spoke. The ClusterProfile and its agent are
// this test's own: the suite's are shared.
func TestDeletedClusterProfileRevokesIssuedTokens(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[1]
	profile := uniqueName(t, "revoked-with-profile")
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, profile, deployment.ProfileAccess(spoke, framework.FleetNamespace, profile))
	require.NoError(t, err)
	stop, err := deployment.StartAgent(ctx, spoke, framework.AgentID(profile))
	require.NoError(t, err)
	defer stop()
	for i, b := range deployment.Brokers {
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			assert.Equal(ct, 1, b.Connected(framework.FleetNamespace, profile), "agent streams of %s", profile)
		}, 10*time.Second, 20*time.Millisecond,
			"replica %d never admits the agent", i)
	}
	c, other := newConsumer(t, "credbroker", profile), newConsumer(t, "credbroker", spoke.Name)
	ns := optIn(t, spoke, "profile-gone", c.username(), other.username())
	tok := mintOn(t, spoke, profile, c, ns, "profile-gone").GetToken()
	// A token of the same spoke through the suite's ClusterProfile.
	otherTok := mintOn(t, spoke, spoke.Name, other, ns, "profile-gone").GetToken()

	require.NoError(t, env.Hub.Inventory.ApisV1alpha1().ClusterProfiles(framework.FleetNamespace).Delete(ctx, profile, metav1.DeleteOptions{}))
	deleted := time.Now()

	refusedAfter(t, spoke, tok, deleted, "its ClusterProfile was deleted")
	assert.NoError(t, selfReview(t, spoke, otherTok), "a token minted through another ClusterProfile was revoked")
	logLine(t, `"msg"="revoked grant"`, `"trigger"="clusterprofile"`, `"subject"="`+c.username()+`"`)
}

// Trigger 4. The attack: a consumer's hub ServiceAccount is deleted, and
// the spoke tokens minted for it stay valid.
func TestDeletedHubServiceAccountRevokesIssuedTokens(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	gone, stays := newConsumer(t, "credbroker", spoke.Name), newConsumer(t, "credbroker", spoke.Name)
	ns := optIn(t, spoke, "hub-sa-gone", gone.username(), stays.username())
	goneTok := mintOn(t, spoke, spoke.Name, gone, ns, "hub-sa-gone").GetToken()
	staysTok := mintOn(t, spoke, spoke.Name, stays, ns, "hub-sa-gone").GetToken()

	require.NoError(t, env.Hub.Client.CoreV1().ServiceAccounts(gone.namespace).Delete(ctx, gone.name, metav1.DeleteOptions{}))
	deleted := time.Now()

	refusedAfter(t, spoke, goneTok, deleted, "the consumer's hub ServiceAccount was deleted")
	assert.NoError(t, selfReview(t, spoke, staysTok), "another consumer's token was revoked")
	logLine(t, `"msg"="revoked grant"`, `"trigger"="serviceaccount"`, `"subject"="`+gone.username()+`"`)
}
