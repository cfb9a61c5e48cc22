package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/credbroker/credbroker/pkg/agent"
	spokepkg "github.com/credbroker/credbroker/pkg/spoke"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// The permissions that let a brokered token make itself a credential that
// no grant binds.
var (
	createTokens = rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"serviceaccounts/token"}, Verbs: []string{"create"}}
	impersonate  = rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"serviceaccounts"}, Verbs: []string{"impersonate"}}
	listNS       = rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"namespaces"}, Verbs: []string{"list"}}
)

// selfMintLifetime is what the attacker asks for: a day, far past the
// agent's maximum of an hour.
const selfMintLifetime = 24 * time.Hour

// escaped is what an attacker got out of a brokered token: a token that no
// grant binds, and how long it lives.
type escaped struct {
	lifetime time.Duration
	// survived: the spoke still accepted it after the grant of the brokered
	// token was deleted and the brokered token was refused.
	survived bool
}

// escape uses the brokered token resp, as its holder would, to mint a token
// of a day for the ServiceAccount ns/target, impersonating ns/as first
// unless as is empty; then revokes the brokered token by deleting its grant,
// and reports whether the new token outlived it.
func escape(t *testing.T, spoke *framework.Cluster, resp *pb.ExchangeResponse, ns, as, target string) escaped {
	t.Helper()
	ctx := context.Background()
	cfg := spoke.TokenConfig(resp.GetToken())
	if as != "" {
		user, _ := framework.ServiceAccountUser(ns, as)
		cfg.Impersonate = rest.ImpersonationConfig{UserName: user}
	}
	brokered, err := kubernetes.NewForConfig(cfg)
	require.NoError(t, err)
	secs := int64(selfMintLifetime / time.Second)
	tr, err := brokered.CoreV1().ServiceAccounts(ns).CreateToken(ctx, target, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &secs},
	}, metav1.CreateOptions{})
	if err != nil {
		require.True(t, apierrors.IsForbidden(err), "the self-mint failed otherwise than forbidden: %v", err)
		return escaped{}
	}
	long := tr.Status.Token
	out := escaped{lifetime: time.Until(tr.Status.ExpirationTimestamp.Time).Round(time.Minute)}

	// Revoke the brokered token as the broker does: delete its grant.
	jti, _ := strings.CutPrefix(resp.GetCredentialId(), "JTI=")
	grant := claimedGrant(ctx, t, spoke, jti)
	require.NoError(t, spoke.Client.CoreV1().Secrets(ns).Delete(ctx, grant.Name, metav1.DeleteOptions{}))
	accepted := func(tok string) bool {
		review, err := spoke.ReviewToken(ctx, tok, nil)
		require.NoError(t, err)
		return review.Authenticated
	}
	framework.Eventually(t, 20*time.Second, 50*time.Millisecond, "the spoke to refuse the brokered token after its grant was deleted", func(c assert.TestingT) {
		assert.False(c, accepted(resp.GetToken()), "the spoke accepts the brokered token of grant %s/%s", ns, grant.Name)
	})
	out.survived = accepted(long)
	return out
}

// requireRefused checks that err is the agent's refusal of an escalating
// ServiceAccount, naming each of want.
func requireRefused(t *testing.T, err error, want ...string) {
	t.Helper()
	require.Error(t, err, "the agent served a ServiceAccount that can escalate")
	require.Equal(t, codes.PermissionDenied, status.Code(err), "%v", err)
	for _, w := range want {
		assert.Contains(t, status.Convert(err).Message(), w)
	}
}

// The case: a ServiceAccount that may create tokens for
// ServiceAccounts in its namespace is refused, naming the permission and
// the agent's setting. Before the check, its brokered token minted itself a
// token of a day, bound to no grant, that outlived the revoke of the grant.
func TestEscalatingServiceAccountIsRefused(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	c := newConsumer(t, "credbroker", spoke.Name)
	ns := optIn(t, spoke, "minter", c.username())
	require.NoError(t, spoke.Grant(ctx, ns, framework.ServiceAccountSubject(ns, "minter"), []rbacv1.PolicyRule{createTokens}))

	resp, err := exchange(t, c, &pb.ExchangeRequest{Cluster: clusterRef(spoke), ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: "minter"}})
	if err == nil {
		got := escape(t, spoke, resp, ns, "", "minter")
		t.Fatalf("the agent served %s/minter, which may create serviceaccounts/token: its brokered token minted itself a token of %s, "+
			"which the spoke still accepted after the grant was revoked: %v", ns, got.lifetime, got.survived)
	}
	requireRefused(t, err, "create serviceaccounts/token", "namespace "+ns, "--allow-escalating-service-accounts="+ns+"/minter")
}

// A ServiceAccount that may only impersonate ServiceAccounts of its
// namespace is refused too: as a ServiceAccount that may mint, its token
// mints tokens that no grant binds.
func TestImpersonatingServiceAccountIsRefused(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	c := newConsumer(t, "credbroker", spoke.Name)
	ns := optIn(t, spoke, "impersonator", c.username())
	require.NoError(t, spoke.Grant(ctx, ns, framework.ServiceAccountSubject(ns, "impersonator"), []rbacv1.PolicyRule{impersonate}))
	// A ServiceAccount of the namespace, not opted in, that may mint: a CI
	// job's, say.
	_, err := spoke.CreateServiceAccount(ctx, ns, "builder", nil)
	require.NoError(t, err)
	require.NoError(t, spoke.Grant(ctx, ns, framework.ServiceAccountSubject(ns, "builder"), []rbacv1.PolicyRule{createTokens}))

	resp, err := exchange(t, c, &pb.ExchangeRequest{Cluster: clusterRef(spoke), ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: "impersonator"}})
	if err == nil {
		got := escape(t, spoke, resp, ns, "builder", "builder")
		t.Fatalf("the agent served %s/impersonator, which may impersonate serviceaccounts: as %s/builder its brokered token minted a token of %s, "+
			"which the spoke still accepted after the grant was revoked: %v", ns, ns, got.lifetime, got.survived)
	}
	requireRefused(t, err, "impersonate serviceaccounts", "--allow-escalating-service-accounts="+ns+"/impersonator")
}

// A ServiceAccount bound to the built-in edit role, as the example once
// was, is refused for both of edit's escalating permissions.
func TestEditServiceAccountIsRefused(t *testing.T) {
	spoke := env.Spokes[0]
	c := newConsumer(t, "credbroker", spoke.Name)
	ns := optIn(t, spoke, "editor", c.username())
	bindEdit(t, spoke, ns, "editor")

	_, err := exchange(t, c, &pb.ExchangeRequest{Cluster: clusterRef(spoke), ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: "editor"}})
	requireRefused(t, err, "create serviceaccounts/token", "impersonate serviceaccounts", ns+"/editor")
}

// A narrow ServiceAccount is served, and its token cannot mint.
func TestNarrowServiceAccountIsServed(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	c := newConsumer(t, "credbroker", spoke.Name)
	ns := optIn(t, spoke, "narrow", c.username())
	require.NoError(t, spoke.Grant(ctx, "", framework.ServiceAccountSubject(ns, "narrow"), []rbacv1.PolicyRule{listNS}))

	resp, err := exchange(t, c, &pb.ExchangeRequest{Cluster: clusterRef(spoke)})
	require.NoError(t, err)
	assert.Equal(t, escaped{}, escape(t, spoke, resp, ns, "", "narrow"), "a narrow token minted itself a token")
}

// A spoke admin may allow an escalating ServiceAccount with the agent's
// setting, and only there. It is then served, and this is what that costs:
// its token mints itself a token of a day that outlives every revoke.
func TestAllowedEscalatingServiceAccountIsServed(t *testing.T) {
	ctx := context.Background()
	cluster := env.Spokes[1]
	name := uniqueName(t, "escalation-allowed")
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, deployment.ProfileAccess(cluster, framework.FleetNamespace, name))
	require.NoError(t, err)
	c := newConsumer(t, "credbroker", name)
	ns := uniqueName(t, "spoke")
	profile := &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: name}

	for _, tt := range []struct {
		name, sa string
		allowed  []types.NamespacedName
		served   bool
	}{
		{name: "another ServiceAccount allowed", sa: "editor-a", allowed: []types.NamespacedName{{Namespace: ns, Name: "other"}}},
		{name: "another namespace allowed", sa: "editor-b", allowed: []types.NamespacedName{{Namespace: ns + "-x", Name: "*"}}},
		{name: "the ServiceAccount allowed", sa: "editor-c", allowed: []types.NamespacedName{{Namespace: ns, Name: "editor-c"}}, served: true},
		{name: "its namespace allowed", sa: "editor-d", allowed: []types.NamespacedName{{Namespace: ns, Name: "*"}}, served: true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			// Each case has a ServiceAccount of its own, so no case is
			// served from the broker's cache of another's token.
			sa, err := cluster.CreateServiceAccount(ctx, ns, tt.sa, map[string]string{spokepkg.AllowedSubjectsAnnotation: c.username()})
			require.NoError(t, err)
			require.NoError(t, deployment.WaitForServiceAccount(ctx, cluster, sa))
			bindEdit(t, cluster, ns, tt.sa)
			stop, err := deployment.StartAgentWith(ctx, cluster, framework.AgentOptions{
				ID: framework.AgentID(name), Namespace: ns,
				Tune: func(cfg *agent.Config) { cfg.AllowEscalatingServiceAccounts = tt.allowed },
			})
			require.NoError(t, err)
			defer stop()
			resp, err := exchange(t, c, &pb.ExchangeRequest{Cluster: profile, ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: tt.sa}})
			if !tt.served {
				requireRefused(t, err, "create serviceaccounts/token")
				return
			}
			require.NoError(t, err)
			got := escape(t, cluster, resp, ns, "", tt.sa)
			t.Logf("allowed: the brokered token minted itself a token of %s; it outlived the revoke: %v", got.lifetime, got.survived)
			assert.Equal(t, escaped{lifetime: selfMintLifetime, survived: true}, got)
		})
	}
}

// bindEdit binds the ServiceAccount ns/name in ns to what the built-in
// ClusterRole edit aggregates (the test API servers run no controller
// manager to aggregate it), and waits until the spoke's authorizer allows
// two of its rules.
func bindEdit(t *testing.T, spoke *framework.Cluster, ns, name string) {
	t.Helper()
	ctx := context.Background()
	for _, role := range []string{"system:aggregate-to-edit", "system:aggregate-to-view"} {
		_, err := spoke.Client.RbacV1().RoleBindings(ns).Create(ctx, &rbacv1.RoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: name + "-" + strings.TrimPrefix(role, "system:aggregate-to-"), Namespace: ns},
			RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role},
			Subjects:   []rbacv1.Subject{framework.ServiceAccountSubject(ns, name)},
		}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	user, _ := framework.ServiceAccountUser(ns, name)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		for _, attrs := range []authorizationv1.ResourceAttributes{
			{Namespace: ns, Verb: "create", Resource: "serviceaccounts", Subresource: "token"},
			{Namespace: ns, Verb: "impersonate", Resource: "serviceaccounts"},
		} {
			review, err := spoke.Client.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{
				Spec: authorizationv1.SubjectAccessReviewSpec{User: user, ResourceAttributes: &attrs},
			}, metav1.CreateOptions{})
			if !assert.NoError(c, err, "SubjectAccessReview of %s %s/%s", attrs.Verb, attrs.Resource, attrs.Subresource) ||
				!assert.True(c, review.Status.Allowed, "%s may %s %s/%s: %+v", user, attrs.Verb, attrs.Resource, attrs.Subresource, review.Status) {
				return
			}
		}
	}, 30*time.Second, 20*time.Millisecond, "edit's rules do not allow %s to create tokens and impersonate in %s", user, ns)
}

// The examples work together and stay narrow: the hub consumer of
// deploy/examples/consumer-rbac.yaml gets a token for the spoke
// ServiceAccount of deploy/examples/spoke-serviceaccount.yaml, which reads
// the workloads of its namespace, reads no Secret and mints no token.
func TestExampleServiceAccountIsServed(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	require.Equal(t, "spoke-1", spoke.Name, "the examples name ClusterProfile fleet/spoke-1")
	dir, err := framework.DeployDir()
	require.NoError(t, err)
	manifests := func(name string) []*unstructured.Unstructured {
		raw, err := os.ReadFile(filepath.Join(dir, "examples", name))
		require.NoError(t, err)
		objs, err := framework.DecodeManifests(raw)
		require.NoError(t, err)
		return objs
	}
	_, err = env.Hub.CreateServiceAccount(ctx, "team-a", "deployer", nil)
	if !apierrors.IsAlreadyExists(err) {
		require.NoError(t, err)
	}
	require.NoError(t, env.Hub.Apply(ctx, manifests("consumer-rbac.yaml")))
	require.NoError(t, spoke.Apply(ctx, manifests("spoke-serviceaccount.yaml")))
	user, _ := framework.ServiceAccountUser("team-a", "deployer")
	allowed := func(c *framework.Cluster, attrs authorizationv1.ResourceAttributes) func(*assert.CollectT) {
		return func(ct *assert.CollectT) {
			review, err := c.Client.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{
				Spec: authorizationv1.SubjectAccessReviewSpec{User: user, ResourceAttributes: &attrs},
			}, metav1.CreateOptions{})
			if assert.NoError(ct, err, "SubjectAccessReview on %s", c.Name) {
				assert.True(ct, review.Status.Allowed, "%s may %s %s/%s %s in %s on %s: %+v",
					user, attrs.Verb, attrs.Resource, attrs.Subresource, attrs.Name, attrs.Namespace, c.Name, review.Status)
			}
		}
	}
	require.EventuallyWithT(t, allowed(env.Hub, authorizationv1.ResourceAttributes{Namespace: framework.FleetNamespace, Verb: "create",
		Group: "multicluster.x-k8s.io", Resource: "clusterprofiles", Subresource: "token", Name: spoke.Name}), 30*time.Second, 20*time.Millisecond,
		"the example's hub RBAC to take effect")
	require.EventuallyWithT(t, allowed(spoke, authorizationv1.ResourceAttributes{Namespace: "team-a", Verb: "list", Resource: "pods"}), 30*time.Second, 20*time.Millisecond,
		"the example's spoke RBAC to take effect")
	sa, err := spoke.Client.CoreV1().ServiceAccounts("team-a").Get(ctx, "deployer", metav1.GetOptions{})
	require.NoError(t, err)
	require.NoError(t, deployment.WaitForServiceAccount(ctx, spoke, sa))

	tok, err := env.Hub.Token(ctx, "team-a", "deployer", []string{"credbroker"}, time.Hour)
	require.NoError(t, err)
	resp, err := exchange(t, consumer{namespace: "team-a", name: "deployer", token: tok}, &pb.ExchangeRequest{Cluster: clusterRef(spoke)})
	require.NoError(t, err)
	assert.Equal(t, &pb.ObjectReference{Namespace: "team-a", Name: "deployer"}, resp.GetServiceAccount())

	client, err := kubernetes.NewForConfig(spoke.TokenConfig(resp.GetToken()))
	require.NoError(t, err)
	_, err = client.CoreV1().Pods("team-a").List(ctx, metav1.ListOptions{})
	require.NoError(t, err, "the example's token reads the workloads of team-a")
	_, err = client.CoreV1().Secrets("team-a").List(ctx, metav1.ListOptions{})
	assert.True(t, apierrors.IsForbidden(err), "the example's token reads Secrets: %v", err)
	assert.Equal(t, escaped{}, escape(t, spoke, resp, "team-a", "", "deployer"), "the example's token minted itself a token")
}
