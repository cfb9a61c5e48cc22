package testpki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

const (
	// caTTL is how long a CA is valid. Long enough for any demo session.
	caTTL = 365 * 24 * time.Hour
	// writeTTL is the lifetime of the certificates the Write helpers issue.
	writeTTL = time.Hour
	// backdate is how far NotBefore lies in the past, for clock skew.
	backdate = time.Minute
)

// CA is a self-signed certificate authority for one SPIFFE trust domain.
// It is safe for concurrent use.
type CA struct {
	td   spiffeid.TrustDomain
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

// NewCA returns a new self-signed ECDSA P-256 CA for trustDomain (such as
// "example.test"). Its certificate carries the trust domain's SPIFFE ID as a
// URI SAN, so it serves both as a SPIFFE X.509 bundle and as a plain TLS CA.
func NewCA(trustDomain string) (*CA, error) {
	td, err := spiffeid.TrustDomainFromString(trustDomain)
	if err != nil {
		return nil, fmt.Errorf("testpki: trust domain %q: %w", trustDomain, err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("testpki: generate CA key: %w", err)
	}
	serial, err := newSerial()
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{Organization: []string{"credbroker testpki"}, CommonName: "testpki CA " + td.Name()},
		NotBefore:             now.Add(-backdate),
		NotAfter:              now.Add(caTTL),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		URIs:                  []*url.URL{td.ID().URL()},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("testpki: sign CA certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("testpki: parse CA certificate: %w", err)
	}
	return &CA{td: td, cert: cert, key: key}, nil
}

// TrustDomain returns the CA's trust domain.
func (ca *CA) TrustDomain() spiffeid.TrustDomain { return ca.td }

// Certificate returns the CA certificate, for an x509.CertPool or an
// x509bundle.Bundle. The caller must not modify it.
func (ca *CA) Certificate() *x509.Certificate { return ca.cert }

// BundlePEM returns the CA certificate as PEM: the trust bundle for SPIFFE
// peers, or the root for TLS clients of a serving certificate.
func (ca *CA) BundlePEM() []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ca.cert.Raw})
}

// IssueSVID issues an X.509-SVID for the SPIFFE ID id, valid for ttl: a leaf
// certificate whose only URI SAN is id, with key usage digitalSignature and
// extended key usages serverAuth and clientAuth. The key is PKCS#8 PEM. id may
// lie outside the CA's trust domain; IssueSVID does not check.
func (ca *CA) IssueSVID(id string, ttl time.Duration) (certPEM, keyPEM []byte, err error) {
	sid, err := spiffeid.FromString(id)
	if err != nil {
		return nil, nil, fmt.Errorf("testpki: SPIFFE ID %q: %w", id, err)
	}
	return ca.issue(&x509.Certificate{
		Subject:     pkix.Name{Organization: []string{"credbroker testpki"}},
		URIs:        []*url.URL{sid.URL()},
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}, ttl)
}

// IssueServing issues an ordinary TLS server certificate for hosts, valid for
// ttl. Each host is a DNS name or an IP address; the first is also the common
// name. The key is PKCS#8 PEM.
func (ca *CA) IssueServing(hosts []string, ttl time.Duration) (certPEM, keyPEM []byte, err error) {
	if len(hosts) == 0 {
		return nil, nil, errors.New("testpki: serving certificate needs at least one host")
	}
	tmpl := &x509.Certificate{
		Subject:     pkix.Name{Organization: []string{"credbroker testpki"}, CommonName: hosts[0]},
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	return ca.issue(tmpl, ttl)
}

// issue fills in the fields every leaf shares, signs tmpl with a fresh key,
// and returns certificate and key as PEM.
func (ca *CA) issue(tmpl *x509.Certificate, ttl time.Duration) (certPEM, keyPEM []byte, err error) {
	if ttl <= 0 {
		return nil, nil, fmt.Errorf("testpki: ttl %v is not positive", ttl)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("testpki: generate key: %w", err)
	}
	serial, err := newSerial()
	if err != nil {
		return nil, nil, err
	}
	now := time.Now()
	tmpl.SerialNumber = serial
	tmpl.NotBefore = now.Add(-backdate)
	tmpl.NotAfter = now.Add(ttl)
	tmpl.BasicConstraintsValid = true
	tmpl.IsCA = false
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		return nil, nil, fmt.Errorf("testpki: sign certificate: %w", err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, nil, fmt.Errorf("testpki: marshal key: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), nil
}

// WriteSVID issues an SVID for id valid for one hour and writes it to dir as
// svid-<id>.pem and svid-<id>-key.pem, where <id> is id's trust domain and
// path with unsafe characters replaced. Writing the same id again replaces
// the files atomically.
func (ca *CA) WriteSVID(dir, id string) (certFile, keyFile string, err error) {
	return ca.WriteSVIDFor(dir, id, writeTTL)
}

// WriteSVIDFor is WriteSVID for an SVID valid for ttl.
func (ca *CA) WriteSVIDFor(dir, id string, ttl time.Duration) (certFile, keyFile string, err error) {
	certPEM, keyPEM, err := ca.IssueSVID(id, ttl)
	if err != nil {
		return "", "", err
	}
	sid, _ := spiffeid.FromString(id) // IssueSVID has parsed it
	return writePair(dir, "svid-"+fileSafe(sid.TrustDomain().Name()+sid.Path()), certPEM, keyPEM)
}

// WriteBundle writes BundlePEM to dir as bundle-<trust domain>.pem and
// returns the file's path.
func (ca *CA) WriteBundle(dir string) (string, error) {
	name := filepath.Join(dir, "bundle-"+fileSafe(ca.td.Name())+".pem")
	if err := WriteFileAtomic(name, ca.BundlePEM(), 0o644); err != nil {
		return "", err
	}
	return name, nil
}

// WriteServing issues a serving certificate for hosts valid for one hour and
// writes it to dir as serving-<first host>.pem and serving-<first host>-key.pem.
func (ca *CA) WriteServing(dir string, hosts ...string) (certFile, keyFile string, err error) {
	certPEM, keyPEM, err := ca.IssueServing(hosts, writeTTL)
	if err != nil {
		return "", "", err
	}
	return writePair(dir, "serving-"+fileSafe(hosts[0]), certPEM, keyPEM)
}

func writePair(dir, base string, certPEM, keyPEM []byte) (certFile, keyFile string, err error) {
	certFile = filepath.Join(dir, base+".pem")
	keyFile = filepath.Join(dir, base+"-key.pem")
	if err := WriteFileAtomic(certFile, certPEM, 0o644); err != nil {
		return "", "", err
	}
	if err := WriteFileAtomic(keyFile, keyPEM, 0o600); err != nil {
		return "", "", err
	}
	return certFile, keyFile, nil
}

// WriteFileAtomic writes data to name through a temporary file in the same
// directory and a rename, so a reader sees the old or the new content, never
// a partial file.
func WriteFileAtomic(name string, data []byte, perm os.FileMode) error {
	f, err := os.CreateTemp(filepath.Dir(name), "."+filepath.Base(name)+".tmp-*")
	if err != nil {
		return fmt.Errorf("testpki: %w", err)
	}
	tmp := f.Name()
	_, werr := f.Write(data)
	cerr := f.Close()
	if err := errors.Join(werr, cerr, os.Chmod(tmp, perm)); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("testpki: write %s: %w", name, err)
	}
	if err := os.Rename(tmp, name); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("testpki: %w", err)
	}
	return nil
}

// fileSafe maps s to a file name: letters, digits, '.', '-' and '_' stay,
// anything else becomes '_'.
func fileSafe(s string) string {
	return strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '.', r == '-', r == '_':
			return r
		}
		return '_'
	}, strings.TrimPrefix(s, "/"))
}

func newSerial() (*big.Int, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
	if err != nil {
		return nil, fmt.Errorf("testpki: serial number: %w", err)
	}
	return serial, nil
}
