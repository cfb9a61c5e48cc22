package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	authenticationv1 "k8s.io/api/authentication/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/credbroker/credbroker/test/framework"
)

// maxExpirationAnnotation, on the agent's ServiceAccount, raises the
// longest token the spoke admits from the agent (deploy/spoke/admission.yaml).
const maxExpirationAnnotation = "credbroker.io/max-token-expiration-seconds"

// The attack: whoever holds the agent's spoke identity creates a grant and
// sends a TokenRequest bound to it with an expirationSeconds of a day (or
// of years): the grant's name is all credbroker-agent-bound-tokens
// checked, so the spoke minted it, and the token outlived every revocation
// that the broker would send for a grant it never tracked. The policy now
// also caps expirationSeconds at the agent's maximum: 3600 s, the agent's
// default --max-expiration, unless the spoke admin raises it with
// credbroker.io/max-token-expiration-seconds on the agent's ServiceAccount.
func TestStolenAgentIdentityCannotMintLongLivedTokens(t *testing.T) {
	ctx := context.Background()
	cluster := env.Spokes[1]
	ns := uniqueName(t, "token-lifetime")
	require.NoError(t, cluster.EnsureNamespace(ctx, ns))
	_, err := cluster.CreateServiceAccount(ctx, ns, "target", nil)
	require.NoError(t, err)
	agent := agentClient(t, cluster)
	g := grantObject("", nil)
	g.GenerateName = "credbroker-grant-"
	applySpokeAdmission(t, cluster, ns)
	g, err = agent.CoreV1().Secrets(ns).Create(ctx, g, metav1.CreateOptions{})
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = cluster.Client.CoreV1().Secrets(ns).Delete(context.Background(), g.Name, metav1.DeleteOptions{})
	})

	// mint sends, as the agent, a TokenRequest bound to the grant; seconds
	// 0 leaves expirationSeconds to the API server's default (3600).
	mint := func(seconds int64) (*authenticationv1.TokenRequest, error) {
		tr := &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{
			BoundObjectRef: &authenticationv1.BoundObjectReference{APIVersion: "v1", Kind: "Secret", Name: g.Name, UID: g.UID},
		}}
		if seconds > 0 {
			tr.Spec.ExpirationSeconds = &seconds
		}
		return agent.CoreV1().ServiceAccounts(ns).CreateToken(ctx, "target", tr, metav1.CreateOptions{})
	}
	lifetime := func(t *testing.T, tr *authenticationv1.TokenRequest) time.Duration {
		t.Helper()
		c := claims(t, tr.Status.Token)
		return time.Until(time.Unix(c.Exp, 0)).Round(time.Minute)
	}
	refused := func(t *testing.T, seconds int64, tr *authenticationv1.TokenRequest, err error, want string) {
		t.Helper()
		if err == nil {
			t.Errorf("the agent's identity minted a bound token of %d s; it lives %s", seconds, lifetime(t, tr))
			return
		}
		assert.True(t, apierrors.IsForbidden(err), "%v", err)
		assert.Contains(t, err.Error(), "ValidatingAdmissionPolicy 'credbroker-agent-bound-tokens'")
		assert.Contains(t, err.Error(), want)
	}

	t.Run("a day, or the API's longest, is refused", func(t *testing.T) {
		for _, seconds := range []int64{86400, 3601, 1<<32 - 1} {
			tr, err := mint(seconds)
			refused(t, seconds, tr, err, "at most 3600 s")
		}
	})

	t.Run("up to the default maximum is allowed", func(t *testing.T) {
		for _, seconds := range []int64{600, 3600, 0} {
			tr, err := mint(seconds)
			require.NoError(t, err, "%d s", seconds)
			assert.LessOrEqual(t, lifetime(t, tr), time.Hour)
		}
	})

	sas := cluster.Client.CoreV1().ServiceAccounts(framework.AgentNamespace)
	annotate := func(t *testing.T, value string) {
		t.Helper()
		patch := `{"metadata":{"annotations":{"` + maxExpirationAnnotation + `":"` + value + `"}}}`
		if value == "" {
			patch = `{"metadata":{"annotations":{"` + maxExpirationAnnotation + `":null}}}`
		}
		_, err := sas.Patch(ctx, framework.AgentServiceAccount, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
		require.NoError(t, err)
	}
	t.Cleanup(func() { annotate(t, "") })

	t.Run("the spoke admin raises the maximum on the agent's ServiceAccount", func(t *testing.T) {
		annotate(t, "7200")
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			_, err := mint(7200)
			assert.NoError(c, err, "the agent's TokenRequest of 7200 s")
		}, 10*time.Second, 100*time.Millisecond, "the agent is never allowed 7200 s")
		tr, err := mint(7201)
		refused(t, 7201, tr, err, "at most 7200 s")
	})

	t.Run("a maximum that is not a number refuses every mint", func(t *testing.T) {
		annotate(t, "a day")
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			_, err := mint(600)
			assert.True(c, apierrors.IsForbidden(err), "the agent's TokenRequest of 600 s: want Forbidden, got %v", err)
		}, 10*time.Second, 100*time.Millisecond, "a malformed maximum still admits")
		tr, err := mint(600)
		refused(t, 600, tr, err, maxExpirationAnnotation)
		annotate(t, "")
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			_, err := mint(3600)
			assert.NoError(c, err, "the agent's TokenRequest of 3600 s")
		}, 10*time.Second, 100*time.Millisecond, "the default maximum never returns")
	})

	t.Run("anyone else mints what the API server allows", func(t *testing.T) {
		seconds := int64(86400)
		_, err := cluster.Client.CoreV1().ServiceAccounts(ns).CreateToken(ctx, "target", &authenticationv1.TokenRequest{
			Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &seconds},
		}, metav1.CreateOptions{})
		require.NoError(t, err)
	})
}
