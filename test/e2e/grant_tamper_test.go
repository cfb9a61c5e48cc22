package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/credbroker/credbroker/pkg/broker"
	"github.com/credbroker/credbroker/pkg/grants"
	"github.com/credbroker/credbroker/pkg/spoke"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// secretEditor may do everything to Secrets in its namespace, as the
// built-in edit role may, and nothing else.
var secretEditor = rbacv1.PolicyRule{
	APIGroups: []string{""},
	Resources: []string{"secrets"},
	Verbs:     []string{"get", "list", "watch", "create", "update", "patch", "delete"},
}

// boundSecret returns the name of the Secret tok is bound to.
func boundSecret(t *testing.T, tok string) string {
	t.Helper()
	name, err := framework.BoundSecret(tok)
	require.NoError(t, err)
	return name
}

// assertRevoked states that broker replica i knows the grant of credential
// id id was revoked.
func assertRevoked(c assert.TestingT, i int, b *broker.Broker, id string) bool {
	return assert.True(c, b.Grants().Revoked(id), "replica %d knows grant %s is revoked (it lists %d grants of it)",
		i, id, len(b.Grants().Select(grants.Selector{CredentialID: id})))
}

// knownToEveryReplica waits until every broker replica lists the grant of
// credential id id.
func knownToEveryReplica(t *testing.T, id string) {
	t.Helper()
	for i, b := range deployment.Brokers {
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			assert.Len(ct, b.Grants().Select(grants.Selector{CredentialID: id}), 1, "replica %d's grants of %s", i, id)
		}, 20*time.Second, 50*time.Millisecond, "replica %d never learnt of grant %s", i, id)
	}
}

// The attack: a spoke ServiceAccount that may edit the Secrets of its own
// namespace (as the built-in edit role may) uses its own brokered token to
// strip the credbroker.io/grant label from the grant its token is bound to,
// whose name the token's kubernetes.io.secret.name claim gives. An agent
// that tracked grants by that label took the grant for deleted and told the
// brokers; the revoke then found nothing, and the token lived to its exp.
// With deploy/spoke/admission.yaml only the agent writes a grant: every
// change by the token's holder is refused, and deleting it, which revokes,
// stays allowed.
func TestConsumerCannotChangeItsGrant(t *testing.T) {
	ctx := context.Background()
	cluster := env.Spokes[0]
	c := newConsumer(t, "credbroker", cluster.Name)
	ns := optIn(t, cluster, "secret-editor", c.username())
	require.NoError(t, cluster.Grant(ctx, ns, framework.ServiceAccountSubject(ns, "secret-editor"), []rbacv1.PolicyRule{secretEditor}))
	applySpokeAdmission(t, cluster, ns)

	resp, err := exchange(t, c, &pb.ExchangeRequest{Cluster: clusterRef(cluster)})
	require.NoError(t, err)
	id := resp.GetCredentialId()
	knownToEveryReplica(t, id)
	name := boundSecret(t, resp.GetToken())
	own, err := kubernetes.NewForConfig(cluster.TokenConfig(resp.GetToken()))
	require.NoError(t, err)
	secrets := own.CoreV1().Secrets(ns)
	before, err := secrets.Get(ctx, name, metav1.GetOptions{})
	require.NoError(t, err, "the token may read its grant")
	require.Equal(t, spoke.GrantType, before.Type)

	refused := func(t *testing.T, err error) {
		t.Helper()
		require.Error(t, err, "the token's holder changed its grant")
		assert.True(t, apierrors.IsForbidden(err), "%v", err)
		assert.Contains(t, err.Error(), "ValidatingAdmissionPolicy 'credbroker-grant-writers'")
		assert.Contains(t, err.Error(), "only the credbroker agent")
	}
	patches := map[string]string{
		"strip the grant label":      `{"metadata":{"labels":{"` + spoke.GrantLabel + `":null}}}`,
		"change the grant label":     `{"metadata":{"labels":{"` + spoke.GrantLabel + `":"false"}}}`,
		"strip the jti label":        `{"metadata":{"labels":{"` + spoke.GrantJTILabel + `":null}}}`,
		"add a label":                `{"metadata":{"labels":{"example.com/x":"y"}}}`,
		"rewrite the hub user":       `{"metadata":{"annotations":{"` + spoke.GrantHubUserAnnotation + `":"system:serviceaccount:hub:someone-else"}}}`,
		"rewrite the ClusterProfile": `{"metadata":{"annotations":{"` + spoke.GrantClusterProfileAnnotation + `":"fleet/other"}}}`,
		"rewrite the credential id":  `{"metadata":{"annotations":{"` + spoke.GrantCredentialIDAnnotation + `":"JTI=00000000-0000-0000-0000-000000000000"}}}`,
		"push the expiry out":        `{"metadata":{"annotations":{"` + spoke.GrantExpirationAnnotation + `":"2999-01-01T00:00:00Z"}}}`,
		"add a finalizer":            `{"metadata":{"finalizers":["example.com/hold"]}}`,
		"add data":                   `{"data":{"k":"dg=="}}`,
	}
	for what, patch := range patches {
		t.Run(what, func(t *testing.T) {
			_, err := secrets.Patch(ctx, name, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
			refused(t, err)
		})
	}
	t.Run("replace the grant whole", func(t *testing.T) {
		g := before.DeepCopy()
		delete(g.Labels, spoke.GrantLabel)
		_, err := secrets.Update(ctx, g, metav1.UpdateOptions{})
		refused(t, err)
	})
	t.Run("create a grant", func(t *testing.T) {
		_, err := secrets.Create(ctx, &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{GenerateName: "credbroker-grant-", Labels: before.Labels, Annotations: before.Annotations},
			Type:       spoke.GrantType,
		}, metav1.CreateOptions{})
		refused(t, err)
	})
	t.Run("other Secrets are the editor's to write", func(t *testing.T) {
		s, err := secrets.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{GenerateName: "mine-"}}, metav1.CreateOptions{})
		require.NoError(t, err)
		_, err = secrets.Patch(ctx, s.Name, types.MergePatchType, []byte(`{"metadata":{"labels":{"`+spoke.GrantLabel+`":"true"}}}`), metav1.PatchOptions{})
		require.NoError(t, err)
		require.NoError(t, secrets.Delete(ctx, s.Name, metav1.DeleteOptions{}))
	})

	after, err := cluster.Client.CoreV1().Secrets(ns).Get(ctx, name, metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, before.ResourceVersion, after.ResourceVersion, "the grant changed")
	require.NoError(t, selfReview(t, cluster, resp.GetToken()), "the token stopped working")
	knownToEveryReplica(t, id)

	// The revoke still reaches the grant, and the token dies.
	revoked, err := revokeGrants(c, grantsClient(t), &pb.GrantSelector{CredentialId: id}, "e2e: the token's holder tried to change its grant")
	require.NoError(t, err)
	require.Len(t, revoked.GetRevoked(), 1, "pending: %v", revoked.GetPending())
	refusedAfter(t, cluster, resp.GetToken(), time.Now(), "an explicit revoke")

	// Deleting a grant is still anyone's right who may delete Secrets: it
	// revokes.
	again, err := exchange(t, c, &pb.ExchangeRequest{Cluster: clusterRef(cluster)})
	require.NoError(t, err)
	require.NotEqual(t, id, again.GetCredentialId())
	// A replica that never heard of the grant has nothing to forget: the
	// delete waits until the claim landed and every replica knows it
	// (test/faults TestTokenWhoseGrantWentBeforeItsClaimIsNotHandedOut
	// deletes it before).
	knownToEveryReplica(t, again.GetCredentialId())
	own, err = kubernetes.NewForConfig(cluster.TokenConfig(again.GetToken()))
	require.NoError(t, err)
	require.NoError(t, own.CoreV1().Secrets(ns).Delete(ctx, boundSecret(t, again.GetToken()), metav1.DeleteOptions{}))
	refusedAfter(t, cluster, again.GetToken(), time.Now(), "its holder deleted its grant")
	for i, b := range deployment.Brokers {
		require.EventuallyWithT(t, func(ct *assert.CollectT) { assertRevoked(ct, i, b, again.GetCredentialId()) }, 20*time.Second, 50*time.Millisecond,
			"replica %d does not know grant %s is gone", i, again.GetCredentialId())
	}
}

// The defence in depth, without admission: someone other than the agent
// (here a spoke admin) changes a grant. The agent tracks grants by their
// type, which nobody can change, so it still sees the grant; it deletes
// it, which revokes its token, and logs what changed. The brokers drop the
// grant only once it is gone, so an explicit revoke right after the change
// still ends the token within 20 s, and the grant never reaches a broker
// with what someone else wrote into it.
func TestGrantChangedByAnotherIsRevoked(t *testing.T) {
	ctx := context.Background()
	cluster := env.Spokes[0]
	client := grantsClient(t)
	tampers := []struct {
		name, patch, change string
	}{
		{name: "label stripped", patch: `{"metadata":{"labels":{"` + spoke.GrantLabel + `":null}}}`, change: "label " + spoke.GrantLabel + " removed"},
		{name: "hub user rewritten", patch: `{"metadata":{"annotations":{"` + spoke.GrantHubUserAnnotation + `":"system:serviceaccount:hub:someone-else"}}}`,
			change: "annotation " + spoke.GrantHubUserAnnotation + " changed"},
		{name: "ClusterProfile rewritten", patch: `{"metadata":{"annotations":{"` + spoke.GrantClusterProfileAnnotation + `":"fleet/other"}}}`,
			change: "annotation " + spoke.GrantClusterProfileAnnotation + " changed"},
		{name: "finalizer added", patch: `{"metadata":{"finalizers":["example.com/hold"]}}`, change: "finalizers added"},
		{name: "data added", patch: `{"data":{"k":"dg=="}}`, change: "data added"},
	}
	type minted struct {
		c    consumer
		ns   string
		resp *pb.ExchangeResponse
	}
	tokens := make([]minted, len(tampers))
	for i := range tampers {
		c := newConsumer(t, "credbroker", cluster.Name)
		ns := optIn(t, cluster, "tampered", c.username())
		resp, err := exchange(t, c, &pb.ExchangeRequest{Cluster: clusterRef(cluster)})
		require.NoError(t, err)
		require.NoError(t, selfReview(t, cluster, resp.GetToken()))
		knownToEveryReplica(t, resp.GetCredentialId())
		tokens[i] = minted{c: c, ns: ns, resp: resp}
	}
	// The tokens die at the spoke's pace, about 10 s: the cases run
	// together.
	t.Run("changes", func(t *testing.T) {
		for i, tt := range tampers {
			m := tokens[i]
			t.Run(tt.name, func(t *testing.T) {
				t.Parallel()
				name := boundSecret(t, m.resp.GetToken())
				secrets := cluster.Client.CoreV1().Secrets(m.ns)
				// An earlier test's admission policies may still be loaded.
				require.EventuallyWithT(t, func(ct *assert.CollectT) {
					_, err := secrets.Patch(ctx, name, types.MergePatchType, []byte(tt.patch), metav1.PatchOptions{})
					assert.NoError(ct, err, "the admin's patch of grant %s/%s", m.ns, name)
				}, 10*time.Second, 50*time.Millisecond, "the admin could not change the grant")
				changed := time.Now()
				revoke, err := revokeGrants(m.c, client, &pb.GrantSelector{CredentialId: m.resp.GetCredentialId()}, "e2e: the grant was changed")
				revoked := time.Now()
				// The grant is either still listed, and the revoke deletes
				// it, or already deleted by the agent; never dropped while
				// it lives. A grant no longer listed is answered as one the
				// caller may not see.
				if err != nil {
					require.Contains(t, []codes.Code{codes.NotFound, codes.PermissionDenied}, status.Code(err), "%v", err)
					_, getErr := secrets.Get(ctx, name, metav1.GetOptions{})
					require.True(t, apierrors.IsNotFound(getErr), "the brokers dropped a grant that still exists: %v", getErr)
				} else {
					require.Len(t, revoke.GetRevoked(), 1, "pending: %v", revoke.GetPending())
				}
				t.Logf("revoke answered %v, %s after the change", status.Code(err), revoked.Sub(changed).Round(time.Millisecond))
				require.EventuallyWithT(t, func(ct *assert.CollectT) {
					_, err := secrets.Get(ctx, name, metav1.GetOptions{})
					assert.True(ct, apierrors.IsNotFound(err), "get grant %s/%s: want NotFound, got %v", m.ns, name, err)
				}, 10*time.Second, 50*time.Millisecond, "the changed grant was not deleted")
				// The agent's delete, or the revoke's, whichever came first.
				line := logLine(t, `"msg"="found a grant that someone other than the agent changed; deleting it"`,
					`"credentialID"="`+m.resp.GetCredentialId()+`"`, tt.change)
				assert.NotContains(t, line, m.resp.GetToken())
				refusedAfter(t, cluster, m.resp.GetToken(), revoked, "a revoke of its changed grant")
				t.Logf("the spoke refused the token %s after the change", time.Since(changed).Round(100*time.Millisecond))
			})
		}
	})
	for _, m := range tokens {
		for i, b := range deployment.Brokers {
			require.EventuallyWithT(t, func(ct *assert.CollectT) { assertRevoked(ct, i, b, m.resp.GetCredentialId()) }, 20*time.Second, 50*time.Millisecond,
				"replica %d does not know grant %s is gone", i, m.resp.GetCredentialId())
		}
	}
}

// Labels and annotations outside credbroker.io/ are not the agent's: a
// mutating webhook or policy that stamps every Secret (a team label, a
// cost annotation) must not make the agent delete every grant. Here a
// spoke admin stamps one, with no admission policy loaded; the grant and
// its token live on, and a change to the agent's own keys on another grant
// is still deleted.
func TestForeignLabelsKeepTheGrant(t *testing.T) {
	ctx := context.Background()
	cluster := env.Spokes[0]
	c := newConsumer(t, "credbroker", cluster.Name)
	ns := optInAudiences(t, cluster, "stamped", []string{"stamped", "tampered"}, c.username())
	stamped, err := exchange(t, c, &pb.ExchangeRequest{Cluster: clusterRef(cluster), Audiences: []string{"stamped"}})
	require.NoError(t, err)
	tampered, err := exchange(t, c, &pb.ExchangeRequest{Cluster: clusterRef(cluster), Audiences: []string{"tampered"}})
	require.NoError(t, err)
	knownToEveryReplica(t, stamped.GetCredentialId())
	knownToEveryReplica(t, tampered.GetCredentialId())
	secrets := cluster.Client.CoreV1().Secrets(ns)
	name := boundSecret(t, stamped.GetToken())

	patch := func(name, patch string) {
		t.Helper()
		// An earlier test's admission policies may still be loaded.
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			_, err := secrets.Patch(ctx, name, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
			assert.NoError(ct, err, "the admin's patch of grant %s/%s", ns, name)
		}, 10*time.Second, 50*time.Millisecond, "the admin could not change the grant")
	}
	patch(name, `{"metadata":{"labels":{"team":"x","example.com/cost-center":"42"},"annotations":{"example.com/owner":"x"}}}`)
	// The agent judges the changes in order: once the second grant, whose
	// own label was removed, is found changed, the first was judged.
	patch(boundSecret(t, tampered.GetToken()), `{"metadata":{"labels":{"`+spoke.GrantLabel+`":null}}}`)
	logLine(t, `"msg"="found a grant that someone other than the agent changed; deleting it"`,
		`"credentialID"="`+tampered.GetCredentialId()+`"`)
	for line := range strings.Lines(logs.String()) {
		assert.False(t, strings.Contains(line, "someone other than the agent changed") &&
			strings.Contains(line, `"credentialID"="`+stamped.GetCredentialId()+`"`),
			"the agent took foreign labels for a change: %s", line)
	}
	got, err := secrets.Get(ctx, name, metav1.GetOptions{})
	require.NoError(t, err, "the agent deleted a grant that only gained foreign labels")
	assert.Equal(t, "x", got.Labels["team"])
	knownToEveryReplica(t, stamped.GetCredentialId())
}
