package identity

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/go-logr/logr"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

// Config is the SPIFFE identity of the broker or an agent, as their Configs
// embed it: where the SVID and bundle come from, and which ID and trust
// domain they must have. Exactly one of SPIFFEEndpointSocket and the three
// files must be set (CheckSourceChoice).
type Config struct {
	// SVIDCertFile, SVIDKeyFile and TrustBundleFile are the process's
	// X.509-SVID and the bundle of TrustDomain, reloaded when they change.
	SVIDCertFile, SVIDKeyFile, TrustBundleFile string
	// SPIFFEEndpointSocket, instead of the three files, is the SPIFFE
	// Workload API (a SPIRE agent's socket) that serves the process's SVID
	// and bundle, such as unix:///run/spire/agent-sockets/spire-agent.sock.
	SPIFFEEndpointSocket string
	// SPIFFEID is the process's own ID: of the SVIDs the Workload API
	// serves, the process takes the one with this ID and refuses others.
	// Zero means the default ID that NewSource is given. The SVID files are
	// used as they are.
	SPIFFEID    spiffeid.ID
	TrustDomain spiffeid.TrustDomain
	// FileCheckInterval is how often the files are read again; the broker
	// reads its other files as often.
	FileCheckInterval time.Duration
}

// DefaultConfig returns a Config with every default set: the files are
// checked every DefaultInterval.
func DefaultConfig() Config {
	return Config{FileCheckInterval: DefaultInterval}
}

// Validate reports every missing or inconsistent field at once; whose
// ("broker", "agent") names the process in the messages.
func (c *Config) Validate(whose string) error {
	var errs []error
	if err := CheckSourceChoice(c.SPIFFEEndpointSocket, c.SVIDCertFile, c.SVIDKeyFile, c.TrustBundleFile); err != nil {
		errs = append(errs, err)
	}
	if c.TrustDomain.IsZero() {
		errs = append(errs, errors.New("the trust domain is required"))
	}
	if !c.SPIFFEID.IsZero() && !c.SPIFFEID.MemberOf(c.TrustDomain) {
		errs = append(errs, fmt.Errorf("the %s's SPIFFE ID %s is not in trust domain %q", whose, c.SPIFFEID, c.TrustDomain))
	}
	return errors.Join(errs...)
}

// NewSource returns the Source that c configures (the package's NewSource):
// the Workload API's SVID must have the ID SPIFFEID, or defaultID when
// SPIFFEID is zero; when both are zero, the first SVID of TrustDomain does.
// log receives the source's reloads and refusals.
func (c *Config) NewSource(ctx context.Context, defaultID spiffeid.ID, log logr.Logger) (Source, error) {
	id := c.SPIFFEID
	if id.IsZero() {
		id = defaultID
	}
	return NewSource(ctx, SourceConfig{
		CertFile: c.SVIDCertFile, KeyFile: c.SVIDKeyFile, BundleFile: c.TrustBundleFile,
		EndpointSocket: c.SPIFFEEndpointSocket, ID: id,
		TrustDomain: c.TrustDomain, Interval: c.FileCheckInterval, Log: log,
	})
}
