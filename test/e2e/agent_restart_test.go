package e2e

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/pkg/spoke"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// aheadClock is the real clock, read offset ahead.
type aheadClock struct {
	clock.RealClock
	offset time.Duration
}

func (c aheadClock) Now() time.Time                  { return c.RealClock.Now().Add(c.offset) }
func (c aheadClock) Since(t time.Time) time.Duration { return c.Now().Sub(t) }

// The case: an agent restarted in the middle collects the grants of
// expired tokens. The agent that minted a token, and holds the timer that
// would delete its grant at expiry, stops; the token expires while no agent
// of its ClusterProfile runs; the agent that starts next finds the grant in
// its informer's first list and deletes it at its first sweep.
//
// A TokenRequest lives at least 10 minutes, so the restarted agent's clock
// runs 11 minutes ahead instead of the test waiting: to it, the token has
// expired. Both agents see only the test's namespace, and the agents that
// the suite runs on the spoke, whose clocks are right, leave the grant
// alone until it really expires; so the collection the test sees is the
// restarted agent's, as its log says.
func TestRestartedAgentCollectsGrantsOfExpiredTokens(t *testing.T) {
	ctx := context.Background()
	cluster := env.Spokes[1]
	name := uniqueName(t, "restarted")
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, deployment.ProfileAccess(cluster, framework.FleetNamespace, name))
	require.NoError(t, err)
	c := newConsumer(t, "credbroker", name)
	ns := optIn(t, cluster, "restarted-sa", c.username())

	stopFirst, err := deployment.StartAgentWith(ctx, cluster, framework.AgentOptions{ID: framework.AgentID(name), Namespace: ns, KeepGrants: true})
	require.NoError(t, err)
	defer stopFirst()
	resp, err := exchange(t, c, &pb.ExchangeRequest{
		Cluster:           &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: name},
		ExpirationSeconds: 600,
	})
	require.NoError(t, err)
	authenticated := func() bool {
		t.Helper()
		review, err := cluster.ReviewToken(ctx, resp.GetToken(), nil)
		require.NoError(t, err)
		return review.Authenticated
	}
	require.True(t, authenticated(), "the spoke refuses a fresh token")
	secrets := cluster.Client.CoreV1().Secrets(ns)
	list, err := secrets.List(ctx, metav1.ListOptions{LabelSelector: spoke.GrantLabelSelector})
	require.NoError(t, err)
	i := slices.IndexFunc(list.Items, func(s corev1.Secret) bool {
		return s.Annotations[spoke.GrantCredentialIDAnnotation] == resp.GetCredentialId()
	})
	require.GreaterOrEqual(t, i, 0, "no grant carries credential id %s", resp.GetCredentialId())
	grant := list.Items[i]

	// The agent dies with the timer of the grant.
	stopFirst()

	lines := &syncBuffer{}
	log := funcr.New(func(prefix, args string) { lines.WriteString(prefix + " " + args + "\n") }, funcr.Options{})
	ahead := time.Until(resp.GetExpirationTime().AsTime()) + time.Minute
	restarted := time.Now()
	stopSecond, err := deployment.StartAgentWith(ctx, cluster, framework.AgentOptions{
		ID: framework.AgentID(name), Namespace: ns, CollectInterval: time.Second,
		Clock: aheadClock{offset: ahead}, Log: &log,
	})
	require.NoError(t, err)
	defer stopSecond()

	require.EventuallyWithT(t, func(c *assert.CollectT) {
		_, err := secrets.Get(ctx, grant.Name, metav1.GetOptions{})
		assert.True(c, apierrors.IsNotFound(err), "get grant %s/%s: want NotFound, got %v; the agent's last lines:\n%s",
			ns, grant.Name, err, framework.LastLines(lines.String(), 20))
	}, 30*time.Second, 50*time.Millisecond, "the restarted agent left the grant of an expired token")
	t.Logf("the restarted agent collected the grant %s after it started", time.Since(restarted).Round(100*time.Millisecond))
	assert.Contains(t, lines.String(), `"msg"="collected expired grant" "grant"="`+ns+"/"+grant.Name+`" "by"="sweep"`)
	framework.Eventually(t, 30*time.Second, 100*time.Millisecond, "the spoke to refuse the token of a collected grant", func(c assert.TestingT) {
		assert.False(c, authenticated(), "the spoke accepts the token of collected grant %s/%s", ns, grant.Name)
	})
	assert.NotContains(t, lines.String(), resp.GetToken())
}
