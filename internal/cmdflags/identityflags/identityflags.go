package identityflags

import (
	"fmt"

	"github.com/spf13/pflag"
	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/credbroker/credbroker/pkg/identity"
)

// Flags are the flags of the SPIFFE identity that the broker and the spoke
// agent share: --svid-cert-file, --svid-key-file,
// --trust-bundle-file, --spiffe-endpoint-socket, --spiffe-id and
// --trust-domain, of an identity.Config.
type Flags struct {
	// Whose is the process whose SVID --spiffe-endpoint-socket serves:
	// "broker" or "agent".
	Whose string
	// SVIDCertFileUsage, TrustBundleFileUsage, SPIFFEIDUsage and
	// TrustDomainUsage are the help of those flags, which say what each
	// binary expects.
	SVIDCertFileUsage, TrustBundleFileUsage, SPIFFEIDUsage, TrustDomainUsage string

	cfg                   *identity.Config
	trustDomain, spiffeID string
}

// AddFlags adds the identity flags to fs, which set cfg: the files and the
// socket as they are parsed, the trust domain and the SPIFFE ID at Apply.
func (f *Flags) AddFlags(fs *pflag.FlagSet, cfg *identity.Config) {
	f.cfg = cfg
	fs.StringVar(&cfg.SVIDCertFile, "svid-cert-file", "", f.SVIDCertFileUsage)
	fs.StringVar(&cfg.SVIDKeyFile, "svid-key-file", "", "PEM key of --svid-cert-file")
	fs.StringVar(&cfg.TrustBundleFile, "trust-bundle-file", "", f.TrustBundleFileUsage)
	fs.StringVar(&cfg.SPIFFEEndpointSocket, "spiffe-endpoint-socket", "", "SPIFFE Workload API address serving the "+f.Whose+
		"'s SVID and bundle, e.g. unix:///run/spire/agent-sockets/spire-agent.sock (instead of the --svid-* and --trust-bundle-file files)")
	fs.StringVar(&f.spiffeID, "spiffe-id", "", f.SPIFFEIDUsage)
	fs.StringVar(&f.trustDomain, "trust-domain", "", f.TrustDomainUsage)
}

// Apply sets the config's TrustDomain from --trust-domain and its SPIFFEID
// from --spiffe-id, each when given; call it after the flags are parsed.
func (f *Flags) Apply() (err error) {
	if f.trustDomain != "" {
		if f.cfg.TrustDomain, err = spiffeid.TrustDomainFromString(f.trustDomain); err != nil {
			return fmt.Errorf("--trust-domain: %w", err)
		}
	}
	if f.spiffeID != "" {
		if f.cfg.SPIFFEID, err = spiffeid.FromString(f.spiffeID); err != nil {
			return fmt.Errorf("--spiffe-id: %w", err)
		}
	}
	return nil
}
