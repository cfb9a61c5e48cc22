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

// NewKeyPairFile loads certFile and keyFile once; it fails when they cannot
// be read or do not form a key pair. interval is how often Run reads them;
// zero means DefaultInterval. log receives reloads and reload failures; the
// zero value discards.
func NewKeyPairFile(certFile, keyFile string, interval time.Duration, log logr.Logger) (*KeyPairFile, error) {
	k := &KeyPairFile{}
	p, err := newFilePoller([]string{certFile, keyFile}, interval, log, func(contents [][]byte) ([]any, error) {
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
	if err := p.load(); err != nil {
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
