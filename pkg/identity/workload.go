package identity

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"github.com/spiffe/go-spiffe/v2/workloadapi"
)

// DefaultWait is how long NewWorkloadSource waits for the Workload API's
// first answer, and NewFileSource and NewKeyPairFile for files that load,
// when no wait is given.
const DefaultWait = time.Minute

// WorkloadSourceConfig configures a WorkloadSource.
type WorkloadSourceConfig struct {
	// Address of the SPIFFE Workload API, such as
	// unix:///run/spire/agent-sockets/spire-agent.sock; required.
	Address string
	// TrustDomain is the one trust domain the source serves; required.
	TrustDomain spiffeid.TrustDomain
	// ID, when set, is the SPIFFE ID the source's SVID must have: of the
	// SVIDs the Workload API serves (SPIRE serves one per registration entry
	// that matches the workload), the source takes the one with this ID and
	// refuses the others. Zero: the first SVID in TrustDomain.
	ID spiffeid.ID
	// Wait bounds NewWorkloadSource's wait for a first answer; zero means
	// DefaultWait.
	Wait time.Duration
	// Log receives refused SVIDs. The zero value discards.
	Log logr.Logger
}

// WorkloadSource serves the X.509-SVID and the trust bundle of one trust
// domain from the SPIFFE Workload API (a SPIRE agent's socket), built on
// go-spiffe's workloadapi.X509Source, which follows the API's pushes. It
// implements Source and is safe for concurrent use.
//
// An update that carries no acceptable SVID (none with the configured ID,
// or none in the trust domain) is logged and the SVID in use stays, as
// FileSource keeps its last good files.
type WorkloadSource struct {
	notifier
	td  spiffeid.TrustDomain
	id  spiffeid.ID
	log logr.Logger
	src *workloadapi.X509Source

	cur     atomic.Pointer[x509svid.SVID]
	mu      sync.Mutex
	refusal error // why the last update's SVIDs were refused; nil if taken
}

var _ Source = (*WorkloadSource)(nil)

// NewWorkloadSource connects to the Workload API and waits, for at most
// cfg.Wait or until ctx ends, for its first SVID and bundle. It fails when
// none comes, when no SVID it serves is acceptable, or when it serves no
// bundle of cfg.TrustDomain. Call Run to follow changes and to close the
// connection at the end.
func NewWorkloadSource(ctx context.Context, cfg WorkloadSourceConfig) (*WorkloadSource, error) {
	if cfg.TrustDomain.IsZero() {
		return nil, errors.New("identity: WorkloadSourceConfig.TrustDomain is required")
	}
	if cfg.Address == "" {
		return nil, errors.New("identity: WorkloadSourceConfig.Address is required")
	}
	if !cfg.ID.IsZero() && !cfg.ID.MemberOf(cfg.TrustDomain) {
		return nil, fmt.Errorf("identity: the expected SPIFFE ID %s is not in trust domain %s", cfg.ID, cfg.TrustDomain)
	}
	if cfg.Wait <= 0 {
		cfg.Wait = DefaultWait
	}
	s := &WorkloadSource{td: cfg.TrustDomain, id: cfg.ID, log: cfg.Log}
	wctx, cancel := context.WithTimeout(ctx, cfg.Wait)
	defer cancel()
	src, err := workloadapi.NewX509Source(wctx,
		workloadapi.WithClientOptions(workloadapi.WithAddr(cfg.Address)),
		workloadapi.WithDefaultX509SVIDPicker(s.pick))
	if err != nil {
		return nil, fmt.Errorf("identity: no X.509-SVID from the Workload API at %s within %s "+
			"(is the SPIRE agent running there, and is this workload registered?): %w", cfg.Address, cfg.Wait, err)
	}
	s.src = src
	if s.cur.Load() == nil {
		_ = src.Close()
		return nil, fmt.Errorf("identity: Workload API at %s: %w", cfg.Address, s.lastRefusal())
	}
	if _, err := src.GetX509BundleForTrustDomain(cfg.TrustDomain); err != nil {
		_ = src.Close()
		return nil, fmt.Errorf("identity: Workload API at %s serves no X.509 bundle of trust domain %s: %w", cfg.Address, cfg.TrustDomain, err)
	}
	return s, nil
}

// pick chooses the SVID to use from those of one Workload API update. It
// runs on go-spiffe's watch goroutine, before the update's bundles are
// stored; Run tells OnChange afterwards.
func (s *WorkloadSource) pick(svids []*x509svid.SVID) *x509svid.SVID {
	for _, svid := range svids {
		if s.acceptable(svid.ID) {
			s.cur.Store(svid)
			s.setRefusal(nil)
			return svid
		}
	}
	want := "X.509-SVID in trust domain " + s.td.String()
	if !s.id.IsZero() {
		want = "X.509-SVID for " + s.id.String()
	}
	err := fmt.Errorf("the Workload API serves no %s; it serves %s: register this workload under that ID, or fix the expected ID", want, describeIDs(svids))
	s.setRefusal(err)
	s.log.Error(err, "refused the Workload API's SVIDs; keeping the SVID in use", "using", s.using())
	return s.cur.Load() // nil before the first acceptable one
}

func (s *WorkloadSource) acceptable(id spiffeid.ID) bool {
	if !s.id.IsZero() {
		return id == s.id
	}
	return id.MemberOf(s.td)
}

func (s *WorkloadSource) using() string {
	if svid := s.cur.Load(); svid != nil {
		return svid.ID.String()
	}
	return ""
}

func (s *WorkloadSource) setRefusal(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.refusal = err
}

func (s *WorkloadSource) lastRefusal() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.refusal == nil {
		return errors.New("the Workload API served no X.509-SVID")
	}
	return s.refusal
}

// Run calls the OnChange functions after every update from the Workload
// API until ctx ends, then closes the connection and returns nil.
func (s *WorkloadSource) Run(ctx context.Context) error {
	defer func() { _ = s.Close() }()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-s.src.Updated():
			if svid := s.cur.Load(); svid != nil {
				s.log.V(1).Info("Workload API update", "id", svid.ID.String(), "expires", svid.Certificates[0].NotAfter)
			}
			s.changed()
		}
	}
}

// Close drops the connection to the Workload API; the source then serves
// nothing. Run closes the source when it returns.
func (s *WorkloadSource) Close() error { return s.src.Close() }

// GetX509SVID returns the SVID in use. Callers must not modify it.
func (s *WorkloadSource) GetX509SVID() (*x509svid.SVID, error) {
	svid := s.cur.Load()
	if svid == nil {
		return nil, errors.New("identity: no X.509-SVID from the Workload API")
	}
	return svid, nil
}

// GetX509BundleForTrustDomain returns the current bundle when td is the
// source's trust domain, and an error for any other, even one the Workload
// API federates with: credbroker trusts one trust domain.
func (s *WorkloadSource) GetX509BundleForTrustDomain(td spiffeid.TrustDomain) (*x509bundle.Bundle, error) {
	if td != s.td {
		return nil, fmt.Errorf("identity: no X.509 bundle for trust domain %q", td)
	}
	return s.src.GetX509BundleForTrustDomain(td)
}
