package testpki

import (
	"crypto/tls"
	"crypto/x509"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestNewCA(t *testing.T) {
	ca, err := NewCA("example.test")
	require.NoError(t, err)
	assert.Equal(t, spiffeid.RequireTrustDomainFromString("example.test"), ca.TrustDomain())
	assert.True(t, ca.Certificate().IsCA)

	bundle, err := x509bundle.Parse(ca.TrustDomain(), ca.BundlePEM())
	require.NoError(t, err)
	assert.True(t, bundle.HasX509Authority(ca.Certificate()))

	_, err = NewCA("Not A Trust Domain")
	require.Error(t, err)
}

func TestIssueSVID(t *testing.T) {
	ca, err := NewCA("example.test")
	require.NoError(t, err)
	bundle, err := x509bundle.Parse(ca.TrustDomain(), ca.BundlePEM())
	require.NoError(t, err)

	tests := []struct {
		name    string
		id      string
		ttl     time.Duration
		wantErr string
	}{
		{name: "agent", id: "spiffe://example.test/clusterprofile/ns/name", ttl: time.Hour},
		{name: "broker", id: "spiffe://example.test/broker", ttl: time.Minute},
		{name: "not a SPIFFE ID", id: "https://example.test/x", ttl: time.Hour, wantErr: `testpki: SPIFFE ID "https://example.test/x"`},
		{name: "zero ttl", id: "spiffe://example.test/x", wantErr: "testpki: ttl 0s is not positive"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			certPEM, keyPEM, err := ca.IssueSVID(tt.id, tt.ttl)
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			svid, err := x509svid.Parse(certPEM, keyPEM)
			require.NoError(t, err)
			assert.Equal(t, tt.id, svid.ID.String())
			id, _, err := x509svid.Verify(svid.Certificates, bundle)
			require.NoError(t, err)
			assert.Equal(t, svid.ID, id)
			leaf := svid.Certificates[0]
			assert.ElementsMatch(t, []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}, leaf.ExtKeyUsage)
			assert.WithinDuration(t, time.Now().Add(tt.ttl), leaf.NotAfter, time.Minute)
		})
	}
}

func TestIssueServing(t *testing.T) {
	ca, err := NewCA("example.test")
	require.NoError(t, err)
	roots := x509.NewCertPool()
	roots.AddCert(ca.Certificate())

	certPEM, keyPEM, err := ca.IssueServing([]string{"broker.example", "127.0.0.1", "::1"}, time.Hour)
	require.NoError(t, err)
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	require.NoError(t, err)
	for _, host := range []string{"broker.example", "127.0.0.1", "::1"} {
		_, err := pair.Leaf.Verify(x509.VerifyOptions{DNSName: host, Roots: roots})
		assert.NoError(t, err, host)
	}
	_, err = pair.Leaf.Verify(x509.VerifyOptions{DNSName: "other.example", Roots: roots})
	assert.Error(t, err)

	_, _, err = ca.IssueServing(nil, time.Hour)
	require.EqualError(t, err, "testpki: serving certificate needs at least one host")
}

func TestWrite(t *testing.T) {
	ca, err := NewCA("example.test")
	require.NoError(t, err)
	dir := t.TempDir()

	certFile, keyFile, err := ca.WriteSVID(dir, "spiffe://example.test/clusterprofile/ns/name")
	require.NoError(t, err)
	assert.Equal(t, filepath.Join(dir, "svid-example.test_clusterprofile_ns_name.pem"), certFile)
	assert.Equal(t, filepath.Join(dir, "svid-example.test_clusterprofile_ns_name-key.pem"), keyFile)
	svid, err := x509svid.Load(certFile, keyFile)
	require.NoError(t, err)
	assert.Equal(t, "spiffe://example.test/clusterprofile/ns/name", svid.ID.String())
	fi, err := os.Stat(keyFile)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), fi.Mode().Perm())

	bundleFile, err := ca.WriteBundle(dir)
	require.NoError(t, err)
	bundle, err := x509bundle.Load(ca.TrustDomain(), bundleFile)
	require.NoError(t, err)
	assert.True(t, bundle.HasX509Authority(ca.Certificate()))

	certFile, keyFile, err = ca.WriteServing(dir, "localhost", "127.0.0.1")
	require.NoError(t, err)
	_, err = tls.LoadX509KeyPair(certFile, keyFile)
	require.NoError(t, err)

	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	assert.Len(t, entries, 5, "no temporary files left behind")
}
