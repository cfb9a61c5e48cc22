package broker

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/utils/clock"
)

// A replica that the hub refuses the triggers' Lease (a single replica
// installed without the Lease's RBAC) fails with an error that names the
// Lease and what to grant, instead of following forever while no replica
// runs the triggers. Other errors are campaigned through.
func TestTriggersLeaseRefusedFails(t *testing.T) {
	for _, tc := range []struct {
		name    string
		err     error
		wantErr string
	}{
		{"forbidden", apierrors.NewForbidden(schema.GroupResource{Group: "coordination.k8s.io", Resource: "leases"}, "credbroker-triggers", errors.New("no RBAC")),
			`the revocation triggers: the hub refused this replica the Lease credbroker-system/credbroker-triggers: forbidden: ` +
				`leases.coordination.k8s.io "credbroker-triggers" is forbidden: no RBAC; grant get, create and update on it (deploy/hub/rbac.yaml, or run one replica with --trigger-lease-name="")`},
		{"hub down", apierrors.NewServiceUnavailable("etcd"), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hub := fake.NewClientset()
			hub.PrependReactor("*", "leases", func(k8stesting.Action) (bool, runtime.Object, error) { return true, nil, tc.err })
			cfg := Default()
			cfg.Clock = clock.RealClock{}
			b := &Broker{cfg: cfg, log: logr.Discard(), hubClient: hub}
			ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
			defer cancel()
			err := b.runTriggers(ctx)
			assert.False(t, b.leadsTriggers.Load())
			if tc.wantErr == "" {
				require.NoError(t, err)
				assert.Error(t, ctx.Err(), "returned before its context ended")
				return
			}
			require.EqualError(t, err, "broker: "+tc.wantErr)
			assert.NoError(t, ctx.Err(), "failed only when its context ended")
		})
	}
}

// A Lease that the hub answers no read or write of for a Lease's duration
// fails readiness with the last error; one answer clears it. Get's
// NotFound (no Lease yet) says nothing either way: Create follows.
func TestLeaseReach(t *testing.T) {
	start := time.Unix(1_800_000_000, 0)
	var r leaseReach
	assert.NoError(t, r.failing(start, leaseDuration))
	missing := errors.New(`namespaces "credbroker-system" not found`)
	r.record(start, missing)
	r.record(start.Add(10*time.Second), missing)
	assert.NoError(t, r.failing(start.Add(leaseDuration-time.Nanosecond), leaseDuration), "failing since less than a Lease's duration")
	assert.Equal(t, missing, r.failing(start.Add(leaseDuration), leaseDuration))
	r.record(start.Add(20*time.Second), nil)
	assert.NoError(t, r.failing(start.Add(time.Hour), leaseDuration), "one answer clears it")

	hub := fake.NewClientset()
	hub.PrependReactor("create", "leases", func(k8stesting.Action) (bool, runtime.Object, error) { return true, nil, missing })
	cfg := Default()
	cfg.Clock = clock.RealClock{}
	b := &Broker{cfg: cfg, log: logr.Discard(), hubClient: hub}
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
	defer cancel()
	require.NoError(t, b.runTriggers(ctx))
	assert.Equal(t, missing, b.triggersLease.failing(time.Now().Add(leaseDuration), leaseDuration),
		"the failed Create is recorded, and the Get before it, which found no Lease, is not an answer")
}
