package metrics

import (
	"crypto/x509"
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

type fakeSVIDs struct {
	svid *x509svid.SVID
	err  error
}

func (f fakeSVIDs) GetX509SVID() (*x509svid.SVID, error) { return f.svid, f.err }

func TestSVIDExpiry(t *testing.T) {
	notAfter := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	tests := []struct {
		name string
		src  fakeSVIDs
		want float64
	}{
		{"an SVID", fakeSVIDs{svid: &x509svid.SVID{Certificates: []*x509.Certificate{{NotAfter: notAfter}}}}, float64(notAfter.Unix())},
		{"no SVID", fakeSVIDs{err: errors.New("none yet")}, 0},
		{"no certificate", fakeSVIDs{svid: &x509svid.SVID{}}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, testutil.ToFloat64(SVIDExpiry("x", "x", tt.src)))
		})
	}
}

func TestBuildInfoAndRegister(t *testing.T) {
	reg := prometheus.NewRegistry()
	require.NoError(t, Register(reg, BuildInfo("credbroker_build_info", "h")))
	assert.Error(t, Register(reg, BuildInfo("credbroker_build_info", "h")), "registered twice")
	n, err := testutil.GatherAndCount(reg, "credbroker_build_info")
	require.NoError(t, err)
	assert.Equal(t, 1, n)
}
