package identityflags

import (
	"testing"

	"github.com/spf13/pflag"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/credbroker/credbroker/internal/cmdflags"
	"github.com/credbroker/credbroker/pkg/identity"
)

func TestFlags(t *testing.T) {
	tests := []struct {
		name                    string
		args                    []string
		want                    identity.Config
		wantTrustDomain, wantID string
		wantErr                 string
	}{
		{name: "none"},
		{name: "files", args: []string{"--svid-cert-file=c", "--svid-key-file=k", "--trust-bundle-file=b", "--trust-domain=fleet.example"},
			want: identity.Config{SVIDCertFile: "c", SVIDKeyFile: "k", TrustBundleFile: "b"}, wantTrustDomain: "fleet.example"},
		{name: "socket and ID", args: []string{"--spiffe-endpoint-socket=unix:///s.sock", "--trust-domain=fleet.example", "--spiffe-id=spiffe://fleet.example/x"},
			want: identity.Config{SPIFFEEndpointSocket: "unix:///s.sock"}, wantTrustDomain: "fleet.example", wantID: "spiffe://fleet.example/x"},
		{name: "bad trust domain", args: []string{"--trust-domain=Fleet!", "--spiffe-id=x"}, wantErr: "--trust-domain: "},
		{name: "bad ID", args: []string{"--trust-domain=fleet.example", "--spiffe-id=x"}, wantErr: "--spiffe-id: "},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var cfg identity.Config
			fs, common := cmdflags.New("test", "Usage: test")
			f := Flags{Whose: "broker", SVIDCertFileUsage: "cert", TrustBundleFileUsage: "bundle", SPIFFEIDUsage: "id", TrustDomainUsage: "td"}
			f.AddFlags(fs, &cfg)
			require.NoError(t, common.Parse(tt.args))
			err := f.Apply()
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.wantTrustDomain, cfg.TrustDomain.Name())
			if tt.wantID == "" {
				assert.True(t, cfg.SPIFFEID.IsZero())
			} else {
				assert.Equal(t, tt.wantID, cfg.SPIFFEID.String())
			}
			cfg.TrustDomain, cfg.SPIFFEID = spiffeid.TrustDomain{}, spiffeid.ID{}
			assert.Equal(t, tt.want, cfg, "the files and the socket")
		})
	}
}

// The help of the identity flags is each binary's, in one order.
func TestFlagsUsage(t *testing.T) {
	fs, common := cmdflags.New("test", "Usage: test")
	f := Flags{Whose: "agent", SVIDCertFileUsage: "the cert", TrustBundleFileUsage: "the bundle", SPIFFEIDUsage: "the ID", TrustDomainUsage: "the domain"}
	f.AddFlags(fs, &identity.Config{})
	var names, usages []string
	fs.VisitAll(func(fl *pflag.Flag) { names, usages = append(names, fl.Name), append(usages, fl.Usage) })
	assert.Equal(t, []string{"svid-cert-file", "svid-key-file", "trust-bundle-file", "spiffe-endpoint-socket", "spiffe-id", "trust-domain"}, names)
	assert.Equal(t, []string{"the cert", "PEM key of --svid-cert-file", "the bundle",
		"SPIFFE Workload API address serving the agent's SVID and bundle, e.g. unix:///run/spire/agent-sockets/spire-agent.sock " +
			"(instead of the --svid-* and --trust-bundle-file files)",
		"the ID", "the domain"}, usages)
	assert.Contains(t, common.Usage(), "--spiffe-endpoint-socket")
}
