package e2e

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// Trust round 3, case 1. The attack: a consumer keeps calling, through
// both replicas, while its access is removed. The revocation trigger
// revoked its grants two seconds after the removal, and its next exchange
// was served from the SubjectAccessReview or TokenReview decision the
// replica had cached a moment before, and minted a new token that nothing
// revoked until the next sweep, minutes later.
// Defence: decisions and revocation are one system. Every replica forgets
// its cached decisions about what changed as soon as its informers see the
// change, and the leader checks a changed ServiceAccount's grants again.
// No token the consumer holds is accepted by the spoke 20 s after the
// removal.
func TestRemovedConsumerKeepsNoTokenFromCachedDecisions(t *testing.T) {
	for _, tc := range []struct {
		name   string
		remove func(t *testing.T, c consumer)
	}{
		{"hub RBAC withdrawn", withdrawRoleBinding},
		{"hub ServiceAccount deleted", func(t *testing.T, c consumer) {
			require.NoError(t, env.Hub.Client.CoreV1().ServiceAccounts(c.namespace).Delete(t.Context(), c.name, metav1.DeleteOptions{}))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			spoke := env.Spokes[0]
			c := newConsumer(t, "credbroker", spoke.Name)
			ns := optIn(t, spoke, "removed-consumer", c.username())
			req := &pb.ExchangeRequest{
				Cluster:        &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: spoke.Name},
				ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: "removed-consumer"},
			}
			var clients []pb.TokenExchangeClient
			for _, b := range deployment.Brokers {
				clients = append(clients, exchangeClientAt(t, b.ExchangeAddr()))
			}

			// The consumer calls every 50 ms, through each replica in turn,
			// and keeps every token it is given.
			var (
				mu     sync.Mutex
				tokens []string
				served int
			)
			ctx, stop := context.WithCancel(t.Context())
			var wg sync.WaitGroup
			wg.Go(func() {
				for i := 0; ctx.Err() == nil; i++ {
					if resp, err := exchangeVia(t, clients[i%len(clients)], c, req); err == nil {
						mu.Lock()
						served++
						if !slices.Contains(tokens, resp.GetToken()) {
							tokens = append(tokens, resp.GetToken())
						}
						mu.Unlock()
					}
					select {
					case <-ctx.Done():
					case <-time.After(50 * time.Millisecond):
					}
				}
			})
			defer wg.Wait()
			defer stop()
			require.EventuallyWithT(t, func(ct *assert.CollectT) {
				mu.Lock()
				defer mu.Unlock()
				assert.GreaterOrEqual(ct, served, 2*len(clients), "exchanges served before the removal")
			}, 30*time.Second, 50*time.Millisecond, "the consumer is served through every replica")

			tc.remove(t, c)
			removed := time.Now()
			// The consumer goes on calling through the removal and the
			// revocation, until the promise's 20 s are over.
			time.Sleep(time.Until(removed.Add(20 * time.Second)))
			stop()
			wg.Wait()

			mu.Lock()
			defer mu.Unlock()
			t.Logf("%d exchanges served, %d distinct tokens", served, len(tokens))
			for i, tok := range tokens {
				require.EventuallyWithT(t, func(ct *assert.CollectT) {
					err := selfReview(t, spoke, tok)
					assert.True(ct, apierrors.IsUnauthorized(err), "token %d of %d: a SelfSubjectReview with it: want Unauthorized, got %v", i+1, len(tokens), err)
				}, 2*time.Second, 100*time.Millisecond, "the spoke still accepts a token of the removed consumer 20 s after the removal")
			}
		})
	}
}
