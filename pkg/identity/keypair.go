package identity

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
)

// KeyPairFile serves an ordinary TLS certificate and key (not an SVID) from
// PEM files and reloads them when they change, the same way FileSource does.
// It is for ports whose clients verify a host name, such as the one that
// serves consumers. It is safe for concurrent use.
type KeyPairFile struct {
	poller *filePoller
	cur    atomic.Pointer[tls.Certificate]
}

// KeyPairFileConfig configures a KeyPairFile.
type KeyPairFileConfig struct {
	// CertFile holds the certificate chain as PEM, leaf first; KeyFile its
	// private key.
	CertFile, KeyFile string
	// Interval is how often Run reads the files; zero means DefaultInterval.
	Interval time.Duration
	// Wait bounds how long NewKeyPairFile reads the files again while they
	// fail, as FileSourceConfig.Wait does; zero means DefaultWait.
	Wait time.Duration
	// Log receives reloads and reload failures. The zero value discards.
	Log logr.Logger
}

// NewKeyPairFile loads the files. While they cannot be read or do not form
// a key pair, it logs why and reads them again; it fails when that still
// holds after cfg.Wait, or when ctx ends.
func NewKeyPairFile(ctx context.Context, cfg KeyPairFileConfig) (*KeyPairFile, error) {
	k := &KeyPairFile{}
	certFile, keyFile := cfg.CertFile, cfg.KeyFile
	p, err := newFilePoller([]string{certFile, keyFile}, cfg.Interval, cfg.Log, func(contents [][]byte) ([]any, error) {
		cert, err := tls.X509KeyPair(contents[0], contents[1])
		if err != nil {
			return nil, fmt.Errorf("identity: key pair in %s and %s: %w", certFile, keyFile, err)
		}
		if cert.Leaf == nil { // GODEBUG=x509keypairleaf=0
			if cert.Leaf, err = x509.ParseCertificate(cert.Certificate[0]); err != nil {
				return nil, fmt.Errorf("identity: certificate in %s: %w", certFile, err)
			}
		}
		k.cur.Store(&cert)
		return []any{"expires", cert.Leaf.NotAfter}, nil
	})
	if err != nil {
		return nil, err
	}
	k.poller = p
	if err := p.load(ctx, cfg.Wait); err != nil {
		return nil, err
	}
	return k, nil
}

// Run reads the files every interval and swaps in the new key pair when they
// change and are valid. A failed reload is logged and the previous key pair
// stays in use. Run returns nil when ctx is done.
func (k *KeyPairFile) Run(ctx context.Context) error {
	return k.poller.run(ctx)
}

// GetCertificate returns the current key pair. It fits
// tls.Config.GetCertificate. Callers must not modify it.
func (k *KeyPairFile) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	return k.cur.Load(), nil
}
