package identity_test

import (
	"context"
	"testing"

	"github.com/go-logr/logr"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/credbroker/credbroker/pkg/identity"
)

// Validate judges the identity part of the broker's and the agent's
// configs, naming whose it is.
func TestConfigValidate(t *testing.T) {
	files := identity.Config{SVIDCertFile: "c", SVIDKeyFile: "k", TrustBundleFile: "b", TrustDomain: td}
	withID := func(c identity.Config, id string) identity.Config {
		c.SPIFFEID = spiffeid.RequireFromString(id)
		return c
	}
	tests := []struct {
		name    string
		cfg     identity.Config
		whose   string
		wantErr string
	}{
		{name: "files", cfg: files, whose: "broker"},
		{name: "socket", cfg: identity.Config{SPIFFEEndpointSocket: "unix:///run/spire/agent.sock", TrustDomain: td}, whose: "agent"},
		{name: "own ID", cfg: withID(files, brokerID), whose: "broker"},
		{name: "ID of another trust domain", cfg: withID(files, "spiffe://other.test/broker"), whose: "broker",
			wantErr: `the broker's SPIFFE ID spiffe://other.test/broker is not in trust domain "example.test"`},
		{name: "every problem at once", cfg: withID(identity.Config{}, agentID), whose: "agent",
			wantErr: "an SVID source is required: the Workload API socket (--spiffe-endpoint-socket), " +
				"or an SVID certificate, key and trust bundle (--svid-cert-file, --svid-key-file, --trust-bundle-file)\n" +
				"the trust domain is required\n" +
				`the agent's SPIFFE ID spiffe://example.test/clusterprofile/ns/name is not in trust domain ""`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.cfg.Validate(tt.whose)
			if tt.wantErr == "" {
				require.NoError(t, err)
				return
			}
			require.EqualError(t, err, tt.wantErr)
		})
	}
}

func TestDefaults(t *testing.T) {
	assert.Equal(t, identity.DefaultInterval, identity.DefaultConfig().FileCheckInterval)
}

// NewSource takes the Workload API's SVID of SPIFFEID, else of the default
// ID it is given, else the first of the trust domain.
func TestConfigNewSourceChoosesTheID(t *testing.T) {
	ca := newCA(t, td.Name())
	api := startWorkloadAPI(t)
	const otherID = "spiffe://example.test/other"
	require.NoError(t, api.Set(ca.BundlePEM(), issue(t, ca, otherID), issue(t, ca, brokerID), issue(t, ca, agentID)))
	tests := []struct {
		name      string
		spiffeID  string
		defaultID string
		want      string
	}{
		{name: "own ID", spiffeID: agentID, defaultID: brokerID, want: agentID},
		{name: "default ID", defaultID: brokerID, want: brokerID},
		{name: "neither", want: otherID},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := identity.Config{SPIFFEEndpointSocket: api.Addr(), TrustDomain: td}
			var def spiffeid.ID
			if tt.spiffeID != "" {
				cfg.SPIFFEID = spiffeid.RequireFromString(tt.spiffeID)
			}
			if tt.defaultID != "" {
				def = spiffeid.RequireFromString(tt.defaultID)
			}
			src, err := cfg.NewSource(context.Background(), def, logr.Discard())
			require.NoError(t, err)
			t.Cleanup(func() { _ = src.(*identity.WorkloadSource).Close() })
			svid, err := src.GetX509SVID()
			require.NoError(t, err)
			assert.Equal(t, tt.want, svid.ID.String())
		})
	}
}
