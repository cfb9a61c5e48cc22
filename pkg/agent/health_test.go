package agent

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/credbroker/credbroker/internal/testpki"
	"github.com/credbroker/credbroker/pkg/identity"
)

// The agent is ready while a broker stream serves and its SVID is valid.
func TestAgentReadiness(t *testing.T) {
	ca, err := testpki.NewCA("test.example")
	require.NoError(t, err)
	dir := t.TempDir()
	cert, key, err := ca.WriteSVIDFor(dir, "spiffe://test.example/clusterprofile/fleet/a", time.Hour)
	require.NoError(t, err)
	bundle, err := ca.WriteBundle(dir)
	require.NoError(t, err)
	svid, err := identity.NewFileSource(identity.FileSourceConfig{CertFile: cert, KeyFile: key, BundleFile: bundle, TrustDomain: ca.TrustDomain()})
	require.NoError(t, err)
	a := &Agent{svid: svid}
	clk := testingclock.NewFakeClock(time.Now())

	err = a.ready(clk)
	require.Error(t, err, "ready without a broker stream")
	assert.Contains(t, err.Error(), "no broker stream serves")

	a.countServing(true)
	a.countServing(true)
	assert.NoError(t, a.ready(clk))
	a.countServing(false) // one broker drains
	assert.NoError(t, a.ready(clk), "one serving stream is enough")

	clk.Step(2 * time.Hour)
	err = a.ready(clk)
	require.Error(t, err, "ready with an expired SVID")
	assert.Contains(t, err.Error(), "expires at")
	clk.Step(-2 * time.Hour)

	a.countServing(false) // the other broker drains too
	assert.Error(t, a.ready(clk))
}
