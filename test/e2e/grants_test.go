package e2e

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"

	"github.com/credbroker/credbroker/pkg/spoke"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// readObjects decodes every object of a deploy/ manifest.
func readObjects(t *testing.T, path string) []any {
	t.Helper()
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	docs := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(raw)))
	var objs []any
	for {
		doc, err := docs.Read()
		if errors.Is(err, io.EOF) {
			return objs
		}
		require.NoError(t, err)
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		obj, _, err := scheme.Codecs.UniversalDeserializer().Decode(doc, nil, nil)
		require.NoError(t, err, "%s", doc)
		objs = append(objs, obj)
	}
}

// applySpokeAdmission creates on spoke the admission policies and bindings
// of deploy/spoke/admission.yaml, as shipped, waits until they refuse the
// agent a Secret in probeNamespace, and deletes them when the test ends.
// grantSecretType is spoke.GrantType, where a parameter named spoke hides
// the package.
const grantSecretType = spoke.GrantType

func applySpokeAdmission(t *testing.T, spoke *framework.Cluster, probeNamespace string) {
	t.Helper()
	ctx := context.Background()
	client := spoke.Client.AdmissionregistrationV1()
	objs := readObjects(t, "../../deploy/spoke/admission.yaml")
	require.Len(t, objs, 6)
	for _, obj := range objs {
		var err error
		switch o := obj.(type) {
		case *admissionregistrationv1.ValidatingAdmissionPolicy:
			_, err = client.ValidatingAdmissionPolicies().Create(ctx, o, metav1.CreateOptions{})
			t.Cleanup(func() {
				_ = client.ValidatingAdmissionPolicies().Delete(context.Background(), o.Name, metav1.DeleteOptions{})
			})
		case *admissionregistrationv1.ValidatingAdmissionPolicyBinding:
			_, err = client.ValidatingAdmissionPolicyBindings().Create(ctx, o, metav1.CreateOptions{})
			t.Cleanup(func() {
				_ = client.ValidatingAdmissionPolicyBindings().Delete(context.Background(), o.Name, metav1.DeleteOptions{})
			})
		default:
			t.Fatalf("deploy/spoke/admission.yaml: no case for %T", obj)
		}
		require.NoError(t, err)
	}
	// A policy takes effect once the API server has loaded it, each on its
	// own: probe every one, in dry runs where the probe could succeed.
	secrets, agent := spoke.Client.CoreV1().Secrets(probeNamespace), agentClient(t, spoke)
	_, err := spoke.CreateServiceAccount(ctx, probeNamespace, "admission-probe", nil)
	require.NoError(t, err)
	dryRun := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
	long := int64(86400)
	probes := map[string]func() error{
		"credbroker-agent-grants": func() error {
			_, err := agent.CoreV1().Secrets(probeNamespace).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{GenerateName: "probe-"}}, dryRun)
			return err
		},
		"credbroker-grant-writers": func() error {
			_, err := secrets.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{GenerateName: "credbroker-grant-"}, Type: grantSecretType}, dryRun)
			return err
		},
		"credbroker-agent-bound-tokens": func() error {
			_, err := agent.CoreV1().ServiceAccounts(probeNamespace).CreateToken(ctx, "admission-probe",
				&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &long}}, dryRun)
			return err
		},
	}
	for policy, probe := range probes {
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			err := probe()
			assert.True(c, apierrors.IsForbidden(err) && strings.Contains(err.Error(), "'"+policy+"'"), "the probe of %s: %v", policy, err)
		}, 10*time.Second, 50*time.Millisecond, "%s is not enforced", policy)
	}
}

// The agent's RBAC as shipped is what the e2e agents run with.
func TestAgentRBACMatchesDeploy(t *testing.T) {
	var roles []*rbacv1.ClusterRole
	for _, obj := range readObjects(t, "../../deploy/spoke/rbac.yaml") {
		if r, ok := obj.(*rbacv1.ClusterRole); ok {
			roles = append(roles, r)
		}
	}
	require.Len(t, roles, 1)
	assert.Equal(t, framework.AgentRules(), roles[0].Rules)
}

// agentClient acts on spoke as the agent's identity.
func agentClient(t *testing.T, spoke *framework.Cluster) kubernetes.Interface {
	t.Helper()
	user, groups := framework.ServiceAccountUser(framework.AgentNamespace, framework.AgentServiceAccount)
	cfg := rest.CopyConfig(spoke.Config)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: user, Groups: append(groups, "system:authenticated")}
	return kubernetes.NewForConfigOrDie(cfg)
}

// grantObject is a grant as the agent writes it, for a ServiceAccount and a
// ClusterProfile that do not exist: the agents leave it alone, as they
// delete any grant that differs from what they write.
func grantObject(name string, data map[string][]byte) *corev1.Secret {
	return &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Name:   name,
			Labels: map[string]string{spoke.GrantLabel: "true", spoke.GrantServiceAccountLabel: "nobody"},
			Annotations: map[string]string{
				spoke.GrantServiceAccountAnnotation:    "nobody",
				spoke.GrantHubUserAnnotation:           "",
				spoke.GrantHubUIDAnnotation:            "",
				spoke.GrantHubGroupsAnnotation:         "",
				spoke.GrantClusterProfileAnnotation:    framework.FleetNamespace + "/no-such-cluster",
				spoke.GrantClusterProfileUIDAnnotation: "",
				spoke.GrantAudiencesAnnotation:         "",
				spoke.GrantExpirationAnnotation:        time.Now().Add(time.Hour).UTC().Format(time.RFC3339),
			},
		},
		Type: spoke.GrantType,
		Data: data,
	}
}

// The attack: whoever holds the agent's identity uses its new power over
// Secrets to write or delete Secrets that are not grants.
func TestAgentAdmissionPolicyConfinesAgentToGrants(t *testing.T) {
	ctx := context.Background()
	cluster := env.Spokes[1]
	ns := uniqueName(t, "grants-policy")
	require.NoError(t, cluster.EnsureNamespace(ctx, ns))
	admin := cluster.Client.CoreV1().Secrets(ns)
	agent := agentClient(t, cluster).CoreV1().Secrets(ns)
	victim, err := admin.Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "db-password"},
		StringData: map[string]string{"password": "hunter2"},
	}, metav1.CreateOptions{})
	require.NoError(t, err)

	applySpokeAdmission(t, cluster, ns)

	refused := func(t *testing.T, err error) {
		t.Helper()
		require.Error(t, err)
		assert.True(t, apierrors.IsForbidden(err), "%v", err)
		assert.Contains(t, err.Error(), "ValidatingAdmissionPolicy 'credbroker-agent-grants'")
	}
	t.Run("the agent may not create a Secret of another type", func(t *testing.T) {
		for _, typ := range []corev1.SecretType{corev1.SecretTypeOpaque, corev1.SecretTypeServiceAccountToken, corev1.SecretTypeDockerConfigJson} {
			s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "not-a-grant"}, Type: typ}
			switch typ {
			case corev1.SecretTypeServiceAccountToken:
				s.Annotations = map[string]string{corev1.ServiceAccountNameKey: "default"}
			case corev1.SecretTypeDockerConfigJson:
				s.Data = map[string][]byte{corev1.DockerConfigJsonKey: []byte(`{"auths":{}}`)}
			}
			_, err := agent.Create(ctx, s, metav1.CreateOptions{})
			refused(t, err)
		}
	})
	t.Run("the agent may not put data in a grant", func(t *testing.T) {
		_, err := agent.Create(ctx, grantObject("with-data", map[string][]byte{"k": []byte("v")}), metav1.CreateOptions{})
		refused(t, err)
	})
	t.Run("the agent may not patch or delete a Secret that is not a grant", func(t *testing.T) {
		_, err := agent.Patch(ctx, victim.Name, types.MergePatchType, []byte(`{"data":{"password":"b3duZWQ="}}`), metav1.PatchOptions{})
		refused(t, err)
		err = agent.Delete(ctx, victim.Name, metav1.DeleteOptions{})
		refused(t, err)
		got, err := admin.Get(ctx, victim.Name, metav1.GetOptions{})
		require.NoError(t, err)
		assert.Equal(t, "hunter2", string(got.Data["password"]))
	})
	t.Run("the agent may not keep a grant alive with a finalizer", func(t *testing.T) {
		g := grantObject("with-finalizer", nil)
		g.Finalizers = []string{"example.com/hold"}
		_, err := agent.Create(ctx, g, metav1.CreateOptions{})
		refused(t, err)
		g, err = agent.Create(ctx, grantObject("finalized-later", nil), metav1.CreateOptions{})
		require.NoError(t, err)
		_, err = agent.Patch(ctx, g.Name, types.MergePatchType, []byte(`{"metadata":{"finalizers":["example.com/hold"]}}`), metav1.PatchOptions{})
		refused(t, err)
		require.NoError(t, agent.Delete(ctx, g.Name, metav1.DeleteOptions{}))
	})
	t.Run("the agent may not hide a grant from collection", func(t *testing.T) {
		g := grantObject("unlabelled", nil)
		g.Labels = nil
		_, err := agent.Create(ctx, g, metav1.CreateOptions{})
		refused(t, err)
		g, err = agent.Create(ctx, grantObject("unlabelled-later", nil), metav1.CreateOptions{})
		require.NoError(t, err)
		_, err = agent.Patch(ctx, g.Name, types.MergePatchType, []byte(`{"metadata":{"labels":{"`+spoke.GrantLabel+`":null}}}`), metav1.PatchOptions{})
		refused(t, err)
		require.NoError(t, agent.Delete(ctx, g.Name, metav1.DeleteOptions{}))
	})
	t.Run("the agent may not rewrite whom a grant is for", func(t *testing.T) {
		for key, values := range map[string][2]string{
			spoke.GrantHubUserAnnotation:           {"system:serviceaccount:hub:a", "system:serviceaccount:hub:b"},
			spoke.GrantHubGroupsAnnotation:         {"system:serviceaccounts", "system:masters"},
			spoke.GrantClusterProfileAnnotation:    {"fleet/a", "fleet/b"},
			spoke.GrantClusterProfileUIDAnnotation: {"uid-a", "uid-b"},
		} {
			g := grantObject("owned", nil)
			g.Annotations[key] = values[0]
			g, err := agent.Create(ctx, g, metav1.CreateOptions{})
			require.NoError(t, err)
			_, err = agent.Patch(ctx, g.Name, types.MergePatchType,
				[]byte(`{"metadata":{"annotations":{"`+key+`":"`+values[1]+`"}}}`), metav1.PatchOptions{})
			refused(t, err)
			require.NoError(t, agent.Delete(ctx, g.Name, metav1.DeleteOptions{}))
		}
	})
	t.Run("the agent may claim a pooled grant once, for its own ServiceAccount", func(t *testing.T) {
		// A pooled grant lives ten minutes; the running agent deletes one
		// that claims to live longer.
		pooled := func() *corev1.Secret {
			g := grantObject("", nil)
			g.GenerateName = "credbroker-grant-"
			g.Annotations[spoke.GrantExpirationAnnotation] = time.Now().Add(5 * time.Minute).UTC().Format(time.RFC3339)
			for _, k := range []string{spoke.GrantHubUserAnnotation, spoke.GrantHubUIDAnnotation, spoke.GrantHubGroupsAnnotation,
				spoke.GrantClusterProfileAnnotation, spoke.GrantClusterProfileUIDAnnotation, spoke.GrantAudiencesAnnotation} {
				delete(g.Annotations, k)
			}
			g, err := agent.Create(ctx, g, metav1.CreateOptions{})
			require.NoError(t, err)
			t.Cleanup(func() { _ = agent.Delete(context.Background(), g.Name, metav1.DeleteOptions{}) })
			return g
		}
		claim := func(sa, user string) []byte {
			return fmt.Appendf(nil, `{"metadata":{"annotations":{%q:%q,%q:%q,%q:"",%q:"",%q:"fleet/a",%q:"uid-a",%q:"",%q:"JTI=x"}}}`,
				spoke.GrantServiceAccountAnnotation, sa, spoke.GrantHubUserAnnotation, user, spoke.GrantHubUIDAnnotation,
				spoke.GrantHubGroupsAnnotation, spoke.GrantClusterProfileAnnotation, spoke.GrantClusterProfileUIDAnnotation,
				spoke.GrantAudiencesAnnotation, spoke.GrantCredentialIDAnnotation)
		}
		_, err := agent.Patch(ctx, pooled().Name, types.MergePatchType, claim("someone-else", "system:serviceaccount:hub:a"), metav1.PatchOptions{})
		refused(t, err)
		_, err = agent.Patch(ctx, pooled().Name, types.MergePatchType, claim("nobody", "system:serviceaccount:hub:a"), metav1.PatchOptions{})
		require.NoError(t, err, "the agent's claim of its pooled grant")
		// A claimed grant is never pooled again, so never claimed again
		// ("may not rewrite whom a grant is for").
		claimed := grantObject("claimed", nil)
		claimed.Annotations[spoke.GrantHubUserAnnotation] = "system:serviceaccount:hub:a"
		claimed, err = agent.Create(ctx, claimed, metav1.CreateOptions{})
		require.NoError(t, err)
		_, err = agent.Patch(ctx, claimed.Name, types.MergePatchType,
			[]byte(`{"metadata":{"annotations":{"`+spoke.GrantHubUserAnnotation+`":null}}}`), metav1.PatchOptions{})
		refused(t, err)
		require.NoError(t, agent.Delete(ctx, claimed.Name, metav1.DeleteOptions{}))
	})
	t.Run("the agent may create, patch and delete a grant", func(t *testing.T) {
		g, err := agent.Create(ctx, grantObject("a-grant", nil), metav1.CreateOptions{})
		require.NoError(t, err)
		_, err = agent.Patch(ctx, g.Name, types.MergePatchType,
			[]byte(`{"metadata":{"labels":{"`+spoke.GrantJTILabel+`":"x"},"annotations":{"`+spoke.GrantCredentialIDAnnotation+`":"JTI=x"}}}`), metav1.PatchOptions{})
		require.NoError(t, err)
		_, err = agent.Patch(ctx, g.Name, types.MergePatchType, []byte(`{"data":{"k":"dg=="}}`), metav1.PatchOptions{})
		refused(t, err)
		require.NoError(t, agent.Delete(ctx, g.Name, metav1.DeleteOptions{}))
	})
	t.Run("the agent may mint only tokens bound to a grant", func(t *testing.T) {
		_, err := cluster.CreateServiceAccount(ctx, ns, "target", nil)
		require.NoError(t, err)
		sas := agentClient(t, cluster).CoreV1().ServiceAccounts(ns)
		mint := func(ref *authenticationv1.BoundObjectReference) error {
			_, err := sas.CreateToken(ctx, "target", &authenticationv1.TokenRequest{
				Spec: authenticationv1.TokenRequestSpec{BoundObjectRef: ref},
			}, metav1.CreateOptions{})
			return err
		}
		refusedBy := func(t *testing.T, err error) {
			t.Helper()
			require.Error(t, err)
			assert.True(t, apierrors.IsForbidden(err), "%v", err)
			assert.Contains(t, err.Error(), "ValidatingAdmissionPolicy 'credbroker-agent-bound-tokens'")
		}
		// This policy may load a moment after the other.
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			err := mint(nil)
			assert.True(c, apierrors.IsForbidden(err), "the agent's unbound TokenRequest: want Forbidden, got %v", err)
		}, 10*time.Second, 50*time.Millisecond, "the agent still mints unbound tokens")
		refusedBy(t, mint(nil))
		refusedBy(t, mint(&authenticationv1.BoundObjectReference{APIVersion: "v1", Kind: "Secret", Name: victim.Name, UID: victim.UID}))
		refusedBy(t, mint(&authenticationv1.BoundObjectReference{APIVersion: "v1", Kind: "Pod", Name: "credbroker-grant-x", UID: "x"}))

		g := grantObject("", nil)
		g.GenerateName = "credbroker-grant-"
		g, err = agent.Create(ctx, g, metav1.CreateOptions{})
		require.NoError(t, err)
		require.NoError(t, mint(&authenticationv1.BoundObjectReference{APIVersion: "v1", Kind: "Secret", Name: g.Name, UID: g.UID}))
		require.NoError(t, agent.Delete(ctx, g.Name, metav1.DeleteOptions{}))

		// Anyone else may still mint unbound tokens.
		_, err = cluster.Client.CoreV1().ServiceAccounts(ns).CreateToken(ctx, "target", &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
		require.NoError(t, err)
	})
	t.Run("everyone else is left alone", func(t *testing.T) {
		s, err := admin.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{GenerateName: "admin-"}}, metav1.CreateOptions{})
		require.NoError(t, err)
		require.NoError(t, admin.Delete(ctx, s.Name, metav1.DeleteOptions{}))
	})
}

// Deleting a token's grant on the spoke makes the spoke refuse the token,
// and the grant names the same credential id as the exchange and the
// broker's audit line.
func TestDeletingGrantRevokesIssuedToken(t *testing.T) {
	ctx := context.Background()
	cluster := env.Spokes[0]
	c := newConsumer(t, "credbroker", cluster.Name)
	ns := optIn(t, cluster, "revocable", c.username())
	// The agent works under the shipped admission policies.
	applySpokeAdmission(t, cluster, ns)
	resp, err := exchange(t, c, &pb.ExchangeRequest{Cluster: clusterRef(cluster)})
	require.NoError(t, err)
	id := resp.GetCredentialId()
	require.Regexp(t, `^JTI=`, id)

	review := func() (*authenticationv1.SelfSubjectReview, error) {
		client, err := kubernetes.NewForConfig(cluster.TokenConfig(resp.GetToken()))
		require.NoError(t, err)
		return client.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	}
	self, err := review()
	require.NoError(t, err)
	assert.Equal(t, "system:serviceaccount:"+ns+":revocable", self.Status.UserInfo.Username)
	assert.Equal(t, []string{id}, []string(self.Status.UserInfo.Extra["authentication.kubernetes.io/credential-id"]))

	// The spoke's own audit log records the request with the credential id.
	var events []framework.AuditEvent
	framework.Eventually(t, 10*time.Second, 50*time.Millisecond, "an event of the brokered token in the spoke's audit log", func(c assert.TestingT) {
		events, err = cluster.AuditEvents(func(ev framework.AuditEvent) bool {
			return ev.User.Username == self.Status.UserInfo.Username && len(ev.User.Extra[framework.CredentialIDExtra]) == 1
		})
		require.NoError(t, err)
		assert.NotEmpty(c, events, "events in %s of %s with a credential id", cluster.AuditLog, self.Status.UserInfo.Username)
	})
	audited := events[0].User.Extra[framework.CredentialIDExtra][0]
	assert.Equal(t, id, audited)

	// The spoke admin's one command, from the audit event to the grant:
	// kubectl get secrets -A -l credbroker.io/jti=<jti>.
	jti, _ := strings.CutPrefix(audited, "JTI=")
	grant := claimedGrant(ctx, t, cluster, jti)
	assert.Equal(t, id, grant.Annotations[spoke.GrantCredentialIDAnnotation])
	assert.Equal(t, spoke.GrantType, grant.Type)
	assert.Empty(t, grant.Data)
	assert.Equal(t, c.username(), grant.Annotations[spoke.GrantHubUserAnnotation])
	assert.Equal(t, framework.FleetNamespace+"/"+cluster.Name, grant.Annotations[spoke.GrantClusterProfileAnnotation])
	assert.Equal(t, "revocable", grant.Annotations[spoke.GrantServiceAccountAnnotation])

	// The broker's audit line names the same credential and hub subject.
	line := logLine(t, `"msg"="exchange"`, `"user"="`+c.username()+`"`, `"credentialID"="`+id+`"`)
	assert.Contains(t, line, `"uid"="`+grant.Annotations[spoke.GrantHubUIDAnnotation]+`"`)

	require.NoError(t, cluster.Client.CoreV1().Secrets(ns).Delete(ctx, grant.Name, metav1.DeleteOptions{}))
	deleted := time.Now()
	refusedAfter(t, cluster, resp.GetToken(), deleted, "its grant was deleted")
}

// setAnnotation sets annotation key on the spoke ServiceAccount ns/name to
// value, as a spoke admin would, and returns when.
func setAnnotation(t *testing.T, cluster *framework.Cluster, ns, name, key, value string) time.Time {
	t.Helper()
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:%q}}}`, key, value)
	_, err := cluster.Client.CoreV1().ServiceAccounts(ns).Patch(context.Background(), name, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
	require.NoError(t, err)
	return time.Now()
}

// The attack: a spoke admin withdraws a consumer's opt-in, or an audience,
// from a ServiceAccount, and the consumer goes on using the tokens it already
// holds for up to their lifetime. The spoke must refuse them within 20 s,
// and only them.
func TestWithdrawnOptInRevokesIssuedTokens(t *testing.T) {
	ctx := context.Background()
	cluster := env.Spokes[0]
	authenticated := func(t *testing.T, tok string, audiences []string) bool {
		t.Helper()
		review, err := cluster.ReviewToken(ctx, tok, audiences)
		require.NoError(t, err)
		return review.Authenticated
	}
	mint := func(t *testing.T, c consumer, ns, name string, audiences ...string) *pb.ExchangeResponse {
		t.Helper()
		resp, err := exchange(t, c, &pb.ExchangeRequest{
			Cluster:        clusterRef(cluster),
			ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: name},
			Audiences:      audiences,
		})
		require.NoError(t, err)
		require.True(t, authenticated(t, resp.GetToken(), audiences), "the spoke refuses a fresh token")
		return resp
	}
	refusedWithin := func(t *testing.T, tok string, audiences []string, since time.Time) {
		t.Helper()
		framework.Eventually(t, 30*time.Second, 100*time.Millisecond, "the spoke to refuse a token whose opt-in was withdrawn", func(c assert.TestingT) {
			assert.False(c, authenticated(t, tok, audiences), "the spoke accepts the token")
		})
		lag := time.Since(since)
		t.Logf("revocation lag: the spoke refused the token %s after the annotation changed", lag.Round(100*time.Millisecond))
		assert.LessOrEqual(t, lag, 20*time.Second)
	}

	t.Run("subject removed from allowed-subjects", func(t *testing.T) {
		gone, stays, other := newConsumer(t, "credbroker", cluster.Name), newConsumer(t, "credbroker", cluster.Name), newConsumer(t, "credbroker", cluster.Name)
		ns := optIn(t, cluster, "shared", gone.username(), stays.username())
		otherNS := optIn(t, cluster, "other", other.username(), gone.username())
		goneResp := mint(t, gone, ns, "shared")
		goneTok := goneResp.GetToken()
		staysTok := mint(t, stays, ns, "shared").GetToken()
		otherTok := mint(t, other, otherNS, "other").GetToken()
		goneOtherTok := mint(t, gone, otherNS, "other").GetToken()

		changed := setAnnotation(t, cluster, ns, "shared", spoke.AllowedSubjectsAnnotation, stays.username())
		refusedWithin(t, goneTok, nil, changed)
		assert.True(t, authenticated(t, staysTok, nil), "a consumer still allowed lost its token")
		assert.True(t, authenticated(t, otherTok, nil), "a token for another ServiceAccount was revoked")
		assert.True(t, authenticated(t, goneOtherTok, nil), "the consumer's token for a ServiceAccount that still allows it was revoked")
		// The agent's log names the revoked credential, never the token.
		line := logLine(t, `"msg"="revoked grant"`, `"credentialID"="`+goneResp.GetCredentialId()+`"`, `"subject"="`+gone.username()+`"`)
		assert.NotContains(t, line, goneTok)
	})

	t.Run("audience removed from allowed-audiences", func(t *testing.T) {
		c := newConsumer(t, "credbroker", cluster.Name)
		ns := optInAudiences(t, cluster, "aud", []string{"vault.example", "sts.example"}, c.username())
		vaultTok := mint(t, c, ns, "aud", "vault.example").GetToken()
		stsTok := mint(t, c, ns, "aud", "sts.example").GetToken()
		defaultTok := mint(t, c, ns, "aud").GetToken()

		changed := setAnnotation(t, cluster, ns, "aud", spoke.AllowedAudiencesAnnotation, "sts.example")
		refusedWithin(t, vaultTok, []string{"vault.example"}, changed)
		assert.True(t, authenticated(t, stsTok, []string{"sts.example"}), "a token for a still-allowed audience was revoked")
		assert.True(t, authenticated(t, defaultTok, nil), "a token for the default audiences was revoked")
	})
}

// claimedGrant returns the one grant on cluster labelled with the token's
// jti, waiting for it: a token minted on a pooled grant is answered
// before the claim that labels its grant lands.
func claimedGrant(ctx context.Context, t *testing.T, cluster *framework.Cluster, jti string) corev1.Secret {
	t.Helper()
	var list *corev1.SecretList
	framework.Eventually(t, 10*time.Second, 50*time.Millisecond, "a grant of credential id JTI="+jti, func(c assert.TestingT) {
		var err error
		list, err = cluster.Client.CoreV1().Secrets("").List(ctx, metav1.ListOptions{LabelSelector: spoke.GrantJTILabel + "=" + jti})
		require.NoError(t, err)
		assert.NotEmpty(c, list.Items, "Secrets labelled %s=%s on %s", spoke.GrantJTILabel, jti, cluster.Name)
	})
	require.Len(t, list.Items, 1, "grants with credential id JTI=%s", jti)
	return list.Items[0]
}
