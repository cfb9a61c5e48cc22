package apiproxy

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
)

// currentAdmitter admits every agent of testCluster's name, and readmits
// only those of the incarnation current holds.
type currentAdmitter struct{ current fleet.ClusterRef }

func (currentAdmitter) Admit(context.Context) (fleet.Admission, error) { return fleet.Admission{}, nil }

func (a currentAdmitter) Readmit(adm fleet.Admission) error {
	if adm.Cluster != a.current {
		return fmt.Errorf("agent %s no longer serves %s: %w", adm.Agent, adm.Cluster, errdefs.ErrPermissionDenied)
	}
	return nil
}

// A data path stream admitted for a ClusterProfile incarnation that was
// replaced before it joined (its join raced the new incarnation's streams)
// does not take the new incarnation's place: its leaving would have left
// the new incarnation's streams carrying nothing, and every request for
// the ClusterProfile answered 503 until they reconnected.
func TestStaleStreamDoesNotReplaceANewerIncarnation(t *testing.T) {
	newer := testCluster
	older := fleet.ClusterRef{NamespacedName: testCluster.NamespacedName, UID: "uid-0"}
	r, err := NewRouter(RouterConfig{Admitter: currentAdmitter{current: newer}, ServerID: "test", Log: logr.Discard()})
	require.NoError(t, err)
	agent := spiffeid.RequireFromString("spiffe://fleet.test/clusterprofile/fleet/private")
	admission := func(c fleet.ClusterRef) fleet.Admission {
		return fleet.Admission{Agent: agent, Cluster: c, Expires: time.Now().Add(time.Hour)}
	}

	_, leave, err := r.join(admission(newer))
	require.NoError(t, err)
	defer leave()
	_, _, err = r.join(admission(older))
	require.ErrorIs(t, err, errdefs.ErrPermissionDenied)
	assert.Equal(t, 1, r.Carriers(newer), "the newer incarnation lost its place")

	// A stream of a newer incarnation still replaces an older one.
	newest := fleet.ClusterRef{NamespacedName: testCluster.NamespacedName, UID: "uid-2"}
	r.cfg.Admitter = currentAdmitter{current: newest}
	_, leaveNewest, err := r.join(admission(newest))
	require.NoError(t, err)
	defer leaveNewest()
	assert.Equal(t, 1, r.Carriers(newest))
}
