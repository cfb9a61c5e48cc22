package identity

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"github.com/spiffe/go-spiffe/v2/workloadapi"
)

// Source is a process's SPIFFE identity: its X.509-SVID and the trust bundle
// of its trust domain, both of which may change at any time, and word of
// when they do. The broker and the agent take a Source; FileSource and
// WorkloadSource are the two there are.
type Source interface {
	x509svid.Source
	x509bundle.Source
	// OnChange registers fn to be called after the SVID or the bundle may
	// have changed, on the goroutine of Run; fn must not block. Calls may
	// come in bursts and for updates that changed nothing, so fn compares
	// what it cares about. The broker verifies its agents' streams again
	// with it; the agent opens new streams with a new SVID.
	OnChange(fn func())
	// Run follows the changes until ctx ends, then releases what the
	// source holds (a Workload API connection), and returns nil.
	Run(ctx context.Context) error
}

// SourceConfig configures NewSource. Exactly one of EndpointSocket and the
// three files must be set.
type SourceConfig struct {
	// CertFile, KeyFile and BundleFile are the SVID, its key and the
	// bundle of TrustDomain as PEM files (see FileSourceConfig).
	CertFile, KeyFile, BundleFile string
	// EndpointSocket is the address of the SPIFFE Workload API, such as
	// unix:///run/spire/agent-sockets/spire-agent.sock.
	EndpointSocket string
	// TrustDomain is the one trust domain the source serves; required.
	TrustDomain spiffeid.TrustDomain
	// ID, when set, is the only SPIFFE ID the Workload API's SVID may have
	// (see WorkloadSourceConfig.ID). Files hold one SVID, which is used
	// whatever its ID within TrustDomain.
	ID spiffeid.ID
	// Interval is how often files are read; zero means DefaultInterval.
	Interval time.Duration
	// Wait bounds the wait for the Workload API's first SVID, or for the
	// files to hold a valid one; zero means DefaultWait.
	Wait time.Duration
	// Log receives reloads and refusals. The zero value discards.
	Log logr.Logger
}

// NewSource returns a WorkloadSource when cfg.EndpointSocket is set, and a
// FileSource otherwise. Call Run to follow changes.
func NewSource(ctx context.Context, cfg SourceConfig) (Source, error) {
	files := cfg.CertFile != "" || cfg.KeyFile != "" || cfg.BundleFile != ""
	switch {
	case cfg.EndpointSocket != "" && files:
		return nil, errors.New("identity: set either the Workload API socket or the SVID and bundle files, not both")
	case cfg.EndpointSocket != "":
		return NewWorkloadSource(ctx, WorkloadSourceConfig{
			Address: cfg.EndpointSocket, TrustDomain: cfg.TrustDomain, ID: cfg.ID, Wait: cfg.Wait, Log: cfg.Log,
		})
	default:
		return NewFileSource(ctx, FileSourceConfig{
			CertFile: cfg.CertFile, KeyFile: cfg.KeyFile, BundleFile: cfg.BundleFile,
			TrustDomain: cfg.TrustDomain, Interval: cfg.Interval, Wait: cfg.Wait, Log: cfg.Log,
		})
	}
}

// notifier keeps the OnChange callbacks of a Source.
type notifier struct {
	mu  sync.Mutex
	fns []func()
}

// OnChange registers fn; see Source.
func (n *notifier) OnChange(fn func()) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.fns = append(n.fns, fn)
}

func (n *notifier) changed() {
	n.mu.Lock()
	fns := slices.Clone(n.fns)
	n.mu.Unlock()
	for _, fn := range fns {
		fn()
	}
}

// SVIDChanges calls fn whenever the SVID that src serves is not the one it
// served at the last call (or at SVIDChanges): a rotation, not a new bundle.
// The agent uses it to open streams with the new SVID.
func SVIDChanges(src Source, fn func(*x509svid.SVID)) {
	var (
		mu   sync.Mutex
		last []byte
	)
	if svid, err := src.GetX509SVID(); err == nil {
		last = svid.Certificates[0].Raw
	}
	src.OnChange(func() {
		svid, err := src.GetX509SVID()
		if err != nil || len(svid.Certificates) == 0 {
			return
		}
		mu.Lock()
		same := slices.Equal(last, svid.Certificates[0].Raw)
		last = svid.Certificates[0].Raw
		mu.Unlock()
		if !same {
			fn(svid)
		}
	})
}

func describeIDs(svids []*x509svid.SVID) string {
	if len(svids) == 0 {
		return "none"
	}
	ids := make([]string, 0, len(svids))
	for _, s := range svids {
		ids = append(ids, s.ID.String())
	}
	return fmt.Sprint(ids)
}

// CheckSourceChoice reports whether exactly one SVID source is chosen: the
// Workload API at socket, or all three of the PEM files. Its messages name
// the flags of the broker and the agent, which share them.
func CheckSourceChoice(socket, certFile, keyFile, bundleFile string) error {
	files := certFile != "" || keyFile != "" || bundleFile != ""
	switch {
	case socket != "" && files:
		return errors.New("set either the Workload API socket (--spiffe-endpoint-socket) or the SVID files " +
			"(--svid-cert-file, --svid-key-file, --trust-bundle-file), not both")
	case socket != "":
		if err := workloadapi.ValidateAddress(socket); err != nil {
			return fmt.Errorf("the Workload API socket (--spiffe-endpoint-socket) %q: %w", socket, err)
		}
		return nil
	case certFile == "" || keyFile == "" || bundleFile == "":
		return errors.New("an SVID source is required: the Workload API socket (--spiffe-endpoint-socket), " +
			"or an SVID certificate, key and trust bundle (--svid-cert-file, --svid-key-file, --trust-bundle-file)")
	}
	return nil
}
