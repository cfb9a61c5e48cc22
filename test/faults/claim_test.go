package faults

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/credbroker/credbroker/pkg/spoke"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// poolCaller is a consumer of one spoke-2 ServiceAccount whose first
// exchange filled the ServiceAccount's grant pool.
type poolCaller struct {
	t     *testing.T
	c     *caller
	first *pb.ExchangeResponse
}

// newPoolCaller makes a consumer's first exchange, which fills its
// ServiceAccount's grant pool, and waits for the pool. Once the first
// token's grant is gone, the next exchange mints on a pooled grant.
func newPoolCaller(t *testing.T) *poolCaller {
	t.Helper()
	p := &poolCaller{t: t, c: newCaller(t, 1, spoke2)}
	p.first = p.exchange()
	ctx := t.Context()
	waitFor(t, 30*time.Second, "the ServiceAccount's grant pool", func(c assert.TestingT) {
		all, err := spoke2.Client.CoreV1().Secrets(p.c.targetNS).List(ctx, metav1.ListOptions{LabelSelector: spoke.GrantLabelSelector})
		require.NoError(t, err)
		claimed, err := spoke2.ClaimedGrants(ctx, p.c.targetNS)
		require.NoError(t, err)
		assert.Greater(c, len(all.Items), len(claimed), "grants in %s, more than the claimed ones", p.c.targetNS)
	})
	return p
}

func (p *poolCaller) exchange() *pb.ExchangeResponse {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(p.c.Context(p.t.Context()), mintTimeout)
	defer cancel()
	resp, err := p.c.client.Exchange(ctx, &pb.ExchangeRequest{
		Cluster:        &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: spoke2.Name},
		ServiceAccount: &pb.ObjectReference{Namespace: p.c.targetNS, Name: p.c.targets[spoke2.Name][0]},
	})
	require.NoError(p.t, err)
	return resp
}

// deleteGrant deletes the grant of resp's token, as a spoke admin.
func (p *poolCaller) deleteGrant(resp *pb.ExchangeResponse) {
	p.t.Helper()
	name, err := framework.BoundSecret(resp.GetToken())
	require.NoError(p.t, err)
	require.NoError(p.t, spoke2.Client.CoreV1().Secrets(p.c.targetNS).Delete(p.t.Context(), name, metav1.DeleteOptions{}))
}

// replaced waits until an exchange answers with another token than old's,
// and returns it.
func (p *poolCaller) replaced(old *pb.ExchangeResponse, what string) (*pb.ExchangeResponse, time.Duration) {
	p.t.Helper()
	var resp *pb.ExchangeResponse
	took := waitFor(p.t, 20*time.Second, what, func(c assert.TestingT) {
		resp = p.exchange()
		assert.NotEqual(c, old.GetCredentialId(), resp.GetCredentialId(), "the credential of the exchange's answer")
	})
	return resp, took
}

// TestTokenWhoseGrantWentBeforeItsClaimIsNotHandedOut: a token bound to a
// pooled grant is answered before the agent claims the grant (writes whose
// it is). Its grant is deleted in between, as its holder may do, which
// revokes it. The broker that minted it cached it, and used to go on
// handing out the dead token until its cache entry's halfway: the grant
// never showed a credential id, so its deletion told the brokers nothing.
// The agent now reports the failed claim's credential id removed, and the
// next exchange mints a token that works.
func TestTokenWhoseGrantWentBeforeItsClaimIsNotHandedOut(t *testing.T) {
	p := newPoolCaller(t)
	// The next mint takes a pooled grant, and its claim is held for a
	// while.
	slowClaims.Store(int64(3 * time.Second))
	t.Cleanup(func() { slowClaims.Store(0) })
	p.deleteGrant(p.first)
	pooled, _ := p.replaced(p.first, "a token in place of the one whose grant was deleted")
	p.deleteGrant(pooled)
	slowClaims.Store(0)

	fresh, took := p.replaced(pooled, "an exchange that does not answer with the token whose grant went before its claim")
	review, err := spoke2.ReviewToken(t.Context(), fresh.GetToken(), nil)
	require.NoError(t, err)
	require.True(t, review.Authenticated, "the new token does not authenticate: %s", review.Error)
	t.Logf("claim race: the broker stopped handing out the token %s after its grant was deleted", took.Round(10*time.Millisecond))
}

// TestRevokeOfATokenWhoseClaimFailedWaitsForItsGrant: the spoke refuses
// the agent's writes (its etcd is down; TokenRequests write nothing and
// still work), so a pooled token's claim fails and so does the agent's
// delete of its grant: the token lives. A revoke of its credential id
// used to be answered revoked at once, while the spoke still took the
// token, because the agent had forgotten the claim and found no grant.
// Now it stays pending, and a revoke once the writes work again deletes
// the grant.
func TestRevokeOfATokenWhoseClaimFailedWaitsForItsGrant(t *testing.T) {
	ctx := t.Context()
	p := newPoolCaller(t)
	failGrantWrites.Store(true)
	t.Cleanup(func() { failGrantWrites.Store(false) })
	p.deleteGrant(p.first)
	pooled, _ := p.replaced(p.first, "a token minted on a pooled grant")
	authenticated := func() bool {
		review, err := spoke2.ReviewToken(ctx, pooled.GetToken(), nil)
		require.NoError(t, err)
		return review.Authenticated
	}
	// The claim is sent right after the answer; a second is plenty for
	// it, and the delete after it, to fail. Were it late, the revoke
	// below would find the claim pending, which it handles the same way.
	time.Sleep(time.Second)
	require.True(t, authenticated(), "the token died though no write reached the spoke")

	_, conn, err := deployment.ExchangeClient(deployment.Broker.ExchangeAddr())
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	revoke := func() *pb.RevokeGrantsResponse {
		t.Helper()
		rctx, cancel := context.WithTimeout(p.c.Context(ctx), 2*mintTimeout)
		defer cancel()
		answer, err := pb.NewGrantsClient(conn).Revoke(rctx, &pb.RevokeGrantsRequest{
			Selector: &pb.GrantSelector{CredentialId: pooled.GetCredentialId()}, Reason: "faults: the token leaked"})
		require.NoError(t, err)
		return answer
	}
	answer := revoke()
	require.Empty(t, answer.GetRevoked(), "a token the spoke still takes was answered revoked")
	require.Len(t, answer.GetPending(), 1)
	require.True(t, authenticated())

	// Once the spoke takes writes again, the revoke deletes the grant.
	failGrantWrites.Store(false)
	answer = revoke()
	require.Len(t, answer.GetRevoked(), 1, "pending: %v", answer.GetPending())
	revoked := time.Now()
	waitFor(t, 40*time.Second, "the spoke to refuse the revoked token", func(c assert.TestingT) {
		assert.False(c, authenticated(), "the revoked token is authenticated")
	})
	t.Logf("failed claim: the spoke refused the token %s after the revoke that found the spoke writable", time.Since(revoked).Round(10*time.Millisecond))
}
