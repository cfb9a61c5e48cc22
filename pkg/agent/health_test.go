package agent

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/credbroker/credbroker/internal/testing/testpki"
	"github.com/credbroker/credbroker/pkg/identity"
)

// The agent is ready while a broker stream serves and its SVID is valid by
// its clock.
func TestAgentReadiness(t *testing.T) {
	ca, err := testpki.NewCA("test.example")
	require.NoError(t, err)
	dir := t.TempDir()
	cert, key, err := ca.WriteSVIDFor(dir, "spiffe://test.example/clusterprofile/fleet/a", time.Hour)
	require.NoError(t, err)
	bundle, err := ca.WriteBundle(dir)
	require.NoError(t, err)
	svid, err := identity.NewFileSource(t.Context(), identity.FileSourceConfig{CertFile: cert, KeyFile: key, BundleFile: bundle, TrustDomain: ca.TrustDomain()})
	require.NoError(t, err)
	_, m, err := newAgentRegistry(svid, []string{"broker:8444"})
	require.NoError(t, err)
	clk := testingclock.NewFakeClock(time.Now())
	a := &Agent{svid: svid, metrics: m, clock: clk}

	err = a.Ready()
	require.Error(t, err, "ready without a broker stream")
	assert.Contains(t, err.Error(), "no broker stream serves")

	a.countServing("broker:8444", true)
	a.countServing("broker:8444", true)
	assert.NoError(t, a.Ready())
	a.countServing("broker:8444", false) // one broker drains
	assert.NoError(t, a.Ready(), "one serving stream is enough")
	assert.Equal(t, 1.0, testutil.ToFloat64(m.streams))
	assert.Equal(t, 1.0, testutil.ToFloat64(m.targetStreams.WithLabelValues("broker:8444")))

	clk.Step(2 * time.Hour)
	err = a.Ready()
	require.Error(t, err, "ready with an expired SVID")
	assert.Contains(t, err.Error(), "expires at")
	clk.Step(-2 * time.Hour)

	a.countServing("broker:8444", false) // the other broker drains too
	assert.Error(t, a.Ready())
	assert.Zero(t, testutil.ToFloat64(m.streams))
	assert.Zero(t, testutil.ToFloat64(m.targetStreams.WithLabelValues("broker:8444")))
}
