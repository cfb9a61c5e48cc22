package broker

import (
	"context"
	"fmt"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/tunnel"
)

// unwiredRevoker is the grant registry's Revoker while the agent tunnel
// carries no revokes: every revoke stays pending.
type unwiredRevoker struct{}

func (unwiredRevoker) Revoke(_ context.Context, cluster tunnel.ClusterRef, _ []string, _ string) ([]string, error) {
	return nil, fmt.Errorf("the agent tunnel of cluster %s does not carry revokes: %w", cluster, errdefs.ErrUnavailable)
}
