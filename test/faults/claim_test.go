package faults

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/credbroker/credbroker/pkg/spoke"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// TestTokenWhoseGrantWentBeforeItsClaimIsNotHandedOut: a token bound to a
// pooled grant is answered before the agent claims the grant (writes whose
// it is). Its grant is deleted in between, as its holder may do, which
// revokes it. The broker that minted it cached it, and used to go on
// handing out the dead token until its cache entry's halfway: the grant
// never showed a credential id, so its deletion told the brokers nothing.
// The agent now reports the failed claim's credential id removed, and the
// next exchange mints a token that works.
func TestTokenWhoseGrantWentBeforeItsClaimIsNotHandedOut(t *testing.T) {
	ctx := t.Context()
	c := newCaller(t, 1, spoke2)
	exchange := func() *pb.ExchangeResponse {
		t.Helper()
		cctx, cancel := context.WithTimeout(c.Context(ctx), mintTimeout)
		defer cancel()
		resp, err := c.client.Exchange(cctx, &pb.ExchangeRequest{
			Cluster:        &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: spoke2.Name},
			ServiceAccount: &pb.ObjectReference{Namespace: c.targetNS, Name: c.targets[spoke2.Name][0]},
		})
		require.NoError(t, err)
		return resp
	}
	deleteGrant := func(resp *pb.ExchangeResponse) {
		t.Helper()
		name, err := framework.BoundSecret(resp.GetToken())
		require.NoError(t, err)
		require.NoError(t, spoke2.Client.CoreV1().Secrets(c.targetNS).Delete(ctx, name, metav1.DeleteOptions{}))
	}
	// replaced waits until an exchange answers with another token than
	// old's, and returns it.
	replaced := func(old *pb.ExchangeResponse, what string) (*pb.ExchangeResponse, time.Duration) {
		t.Helper()
		var resp *pb.ExchangeResponse
		took := waitFor(t, 20*time.Second, what, func() bool {
			resp = exchange()
			return resp.GetCredentialId() != old.GetCredentialId()
		})
		return resp, took
	}

	// The first mint for the ServiceAccount fills its pool. Once its
	// grant is gone, the next mint takes a pooled grant, and its claim is
	// held for a while.
	first := exchange()
	waitFor(t, 30*time.Second, "the ServiceAccount's grant pool", func() bool {
		all, err := spoke2.Client.CoreV1().Secrets(c.targetNS).List(ctx, metav1.ListOptions{LabelSelector: spoke.GrantLabelSelector})
		require.NoError(t, err)
		claimed, err := spoke2.ClaimedGrants(ctx, c.targetNS)
		require.NoError(t, err)
		return len(all.Items) > len(claimed)
	})
	slowClaims.Store(int64(3 * time.Second))
	t.Cleanup(func() { slowClaims.Store(0) })
	deleteGrant(first)
	pooled, _ := replaced(first, "a token in place of the one whose grant was deleted")
	deleteGrant(pooled)
	slowClaims.Store(0)

	fresh, took := replaced(pooled, "an exchange that does not answer with the token whose grant went before its claim")
	review, err := spoke2.ReviewToken(ctx, fresh.GetToken(), nil)
	require.NoError(t, err)
	require.True(t, review.Authenticated, "the new token does not authenticate: %s", review.Error)
	t.Logf("claim race: the broker stopped handing out the token %s after its grant was deleted", took.Round(10*time.Millisecond))
}
