package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/credbroker/credbroker/pkg/broker"
)

// Trust round 3, case 7. The attack (an accident here, but one anyone who
// may delete the broker's namespace can cause): the namespace of the
// triggers' Lease does not exist. The broker could not create its Lease,
// logged an error every few seconds, stayed ready and kept minting, and no
// revocation trigger ran: RBAC removals and ServiceAccount deletions took
// 40 s to revoke.
// Defence: a replica that the hub has answered no read or write of the
// Lease for a Lease's duration (15 s) is not ready, with a message that
// names the namespace to create; once it exists, the replica takes the
// Lease and is ready again.
func TestBrokerWithoutItsLeaseNamespaceIsNotReady(t *testing.T) {
	ctx := t.Context()
	cfg := deployment.BrokerConfig()
	cfg.PendingRevokesNamespace = uniqueName(t, "missing-broker-ns")
	b, err := broker.New(cfg)
	require.NoError(t, err)
	bctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- b.Run(bctx) }()
	t.Cleanup(func() {
		stop()
		assert.NoError(t, <-done)
	})

	require.EventuallyWithT(t, func(c *assert.CollectT) {
		err := b.Ready()
		if assert.Error(c, err, "the broker is ready without its Lease's namespace") {
			assert.Contains(c, err.Error(), "the revocation triggers cannot run")
			assert.Contains(c, err.Error(), `create the namespace "`+cfg.PendingRevokesNamespace+`"`)
		}
	}, 60*time.Second, 200*time.Millisecond, "the broker never says that its triggers cannot run")

	require.NoError(t, env.Hub.EnsureNamespace(ctx, cfg.PendingRevokesNamespace))
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.NoError(c, b.Ready())
	}, 60*time.Second, 200*time.Millisecond, "the broker is not ready once the namespace exists")
}
