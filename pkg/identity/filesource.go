package identity

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// FileSourceConfig configures a FileSource.
type FileSourceConfig struct {
	// CertFile holds the X.509-SVID: PEM certificates, leaf first, then any
	// intermediates.
	CertFile string
	// KeyFile holds the SVID's private key as PKCS#8 PEM.
	KeyFile string
	// BundleFile holds the trust bundle of TrustDomain: PEM CA certificates.
	BundleFile string
	// TrustDomain is the one trust domain the source serves. The SVID's ID
	// must be a member of it.
	TrustDomain spiffeid.TrustDomain
	// Interval is how often the files are read for changes; zero means
	// DefaultInterval.
	Interval time.Duration
	// Wait bounds how long NewFileSource reads the files again while they
	// fail, such as a certificate and key caught between two writes of a
	// rotation; zero means DefaultWait.
	Wait time.Duration
	// Log receives reloads and reload failures. The zero value discards.
	Log logr.Logger
}

// FileSource serves an X.509-SVID and the trust bundle of one trust domain
// from PEM files, such as a volume that a SPIFFE CSI driver or cert-manager
// keeps up to date, and reloads them when they change. It implements
// x509svid.Source and x509bundle.Source and is safe for concurrent use.
type FileSource struct {
	notifier
	td     spiffeid.TrustDomain
	poller *filePoller
	cur    atomic.Pointer[fileSourceState]
}

type fileSourceState struct {
	svid   *x509svid.SVID
	bundle *x509bundle.Bundle
}

var _ Source = (*FileSource)(nil)

// NewFileSource loads the files. While a file cannot be read, the SVID or
// the bundle is invalid, the key does not match the SVID, or the SVID's ID
// is not a member of cfg.TrustDomain, it logs why and reads them again; it
// fails when that still holds after cfg.Wait, or when ctx ends. Call Run to
// follow changes.
func NewFileSource(ctx context.Context, cfg FileSourceConfig) (*FileSource, error) {
	if cfg.TrustDomain.IsZero() {
		return nil, errors.New("identity: FileSourceConfig.TrustDomain is required")
	}
	if cfg.CertFile == "" || cfg.KeyFile == "" || cfg.BundleFile == "" {
		return nil, errors.New("identity: FileSourceConfig needs CertFile, KeyFile and BundleFile")
	}
	s := &FileSource{td: cfg.TrustDomain}
	p, err := newFilePoller([]string{cfg.CertFile, cfg.KeyFile, cfg.BundleFile}, cfg.Interval, cfg.Log,
		func(contents [][]byte) ([]any, error) {
			st, err := parseFileSource(cfg, contents[0], contents[1], contents[2])
			if err != nil {
				return nil, err
			}
			s.cur.Store(st)
			s.changed()
			return []any{"id", st.svid.ID.String(), "expires", st.svid.Certificates[0].NotAfter}, nil
		})
	if err != nil {
		return nil, err
	}
	s.poller = p
	if err := p.load(ctx, cfg.Wait); err != nil {
		return nil, err
	}
	return s, nil
}

func parseFileSource(cfg FileSourceConfig, certPEM, keyPEM, bundlePEM []byte) (*fileSourceState, error) {
	svid, err := x509svid.Parse(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("identity: SVID in %s and %s: %w", cfg.CertFile, cfg.KeyFile, err)
	}
	if !svid.ID.MemberOf(cfg.TrustDomain) {
		return nil, fmt.Errorf("identity: SVID in %s: ID %s is not in trust domain %s", cfg.CertFile, svid.ID, cfg.TrustDomain)
	}
	bundle, err := x509bundle.Parse(cfg.TrustDomain, bundlePEM)
	if err != nil {
		return nil, fmt.Errorf("identity: bundle in %s: %w", cfg.BundleFile, err)
	}
	if bundle.Empty() {
		return nil, fmt.Errorf("identity: bundle in %s: no certificates", cfg.BundleFile)
	}
	return &fileSourceState{svid: svid, bundle: bundle}, nil
}

// Run reads the files every Interval and swaps in their new contents when
// they change and are valid. A failed reload is logged and the previous SVID
// and bundle stay in use. Run returns nil when ctx is done.
func (s *FileSource) Run(ctx context.Context) error {
	return s.poller.run(ctx)
}

// GetX509SVID returns the current X.509-SVID. Callers must not modify it.
func (s *FileSource) GetX509SVID() (*x509svid.SVID, error) {
	return s.cur.Load().svid, nil
}

// GetX509BundleForTrustDomain returns the current bundle when td is the
// source's trust domain, and an error for any other.
func (s *FileSource) GetX509BundleForTrustDomain(td spiffeid.TrustDomain) (*x509bundle.Bundle, error) {
	if td != s.td {
		return nil, fmt.Errorf("identity: no X.509 bundle for trust domain %q", td)
	}
	return s.cur.Load().bundle, nil
}
