package identity_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/credbroker/credbroker/pkg/identity"
)

func TestNewKeyPairFile(t *testing.T) {
	ca := newCA(t, "example.test")
	certPEM, keyPEM, err := ca.IssueServing([]string{"broker.example"}, time.Hour)
	require.NoError(t, err)
	_, otherKey, err := ca.IssueServing([]string{"broker.example"}, time.Hour)
	require.NoError(t, err)

	tests := []struct {
		name     string
		cert     []byte
		key      []byte
		interval time.Duration
		wantErr  string
	}{
		{name: "valid", cert: certPEM, key: keyPEM},
		{name: "missing cert", key: keyPEM, wantErr: "tls.crt: no such file or directory"},
		{name: "missing key", cert: certPEM, wantErr: "tls.key: no such file or directory"},
		{name: "key does not match", cert: certPEM, key: otherKey, wantErr: "private key does not match public key"},
		{name: "garbage", cert: []byte("hello"), key: keyPEM, wantErr: "failed to find any PEM data in certificate input"},
		{name: "negative interval", cert: certPEM, key: keyPEM, interval: -time.Second, wantErr: "identity: interval -1s is negative"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
			if tt.cert != nil {
				require.NoError(t, os.WriteFile(certFile, tt.cert, 0o600))
			}
			if tt.key != nil {
				require.NoError(t, os.WriteFile(keyFile, tt.key, 0o600))
			}
			kp, err := identity.NewKeyPairFile(t.Context(), identity.KeyPairFileConfig{
				CertFile: certFile, KeyFile: keyFile, Interval: tt.interval, Wait: failWait,
			})
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			cert, err := kp.GetCertificate(nil)
			require.NoError(t, err)
			assert.Equal(t, []string{"broker.example"}, cert.Leaf.DNSNames)
		})
	}

	_, err = identity.NewKeyPairFile(t.Context(), identity.KeyPairFileConfig{KeyFile: "tls.key"})
	require.EqualError(t, err, "identity: file 1 of 2 has no name")
}

func TestKeyPairFileReload(t *testing.T) {
	ca := newCA(t, "example.test")
	vol := newProjectedDir(t)
	serving := func(host string) map[string][]byte {
		certPEM, keyPEM, err := ca.IssueServing([]string{host, "127.0.0.1"}, time.Hour)
		require.NoError(t, err)
		return map[string][]byte{"tls.crt": certPEM, "tls.key": keyPEM}
	}
	vol.write(serving("first.example"))
	logs := &logRecorder{}
	kp, err := identity.NewKeyPairFile(t.Context(), identity.KeyPairFileConfig{
		CertFile: vol.path("tls.crt"), KeyFile: vol.path("tls.key"), Interval: pollInterval, Log: logs.logger(),
	})
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- kp.Run(ctx) }()
	defer func() {
		cancel()
		require.NoError(t, <-done)
	}()

	// A TLS server with GetCertificate serves whatever is current.
	lis, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{GetCertificate: kp.GetCertificate})
	require.NoError(t, err)
	defer lis.Close()
	go func() {
		for {
			conn, err := lis.Accept()
			if err != nil {
				return
			}
			_ = conn.(*tls.Conn).Handshake()
			_ = conn.Close()
		}
	}()
	roots := x509.NewCertPool()
	roots.AddCert(ca.Certificate())
	servedName := func() string {
		conn, err := tls.Dial("tcp", lis.Addr().String(), &tls.Config{RootCAs: roots, ServerName: "127.0.0.1"})
		require.NoError(t, err)
		defer conn.Close()
		return conn.ConnectionState().PeerCertificates[0].DNSNames[0]
	}
	assert.Equal(t, "first.example", servedName())

	vol.write(serving("second.example"))
	require.Eventually(t, func() bool {
		cert, err := kp.GetCertificate(nil)
		require.NoError(t, err)
		return cert.Leaf.DNSNames[0] == "second.example"
	}, 5*time.Second, pollInterval)
	assert.Equal(t, "second.example", servedName())

	// A broken update keeps the second pair.
	vol.write(map[string][]byte{"tls.crt": []byte("garbage"), "tls.key": serving("third.example")["tls.key"]})
	waitForError(t, logs, "failed to find any PEM data in certificate input")
	assert.Equal(t, "second.example", servedName())
}

// Under GODEBUG=x509keypairleaf=0, tls.X509KeyPair leaves Leaf nil; the
// key pair still serves its parsed certificate, whose NotAfter the reload
// log and the callers read.
func TestKeyPairFileParsesTheLeafItself(t *testing.T) {
	t.Setenv("GODEBUG", "x509keypairleaf=0")
	ca := newCA(t, "example.test")
	certPEM, keyPEM, err := ca.IssueServing([]string{"broker.example"}, time.Hour)
	require.NoError(t, err)
	leafless, err := tls.X509KeyPair(certPEM, keyPEM)
	require.NoError(t, err)
	require.Nil(t, leafless.Leaf, "GODEBUG=x509keypairleaf=0 no longer leaves Leaf nil; this test tests nothing")

	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	require.NoError(t, os.WriteFile(certFile, certPEM, 0o600))
	require.NoError(t, os.WriteFile(keyFile, keyPEM, 0o600))
	kp, err := identity.NewKeyPairFile(t.Context(), identity.KeyPairFileConfig{CertFile: certFile, KeyFile: keyFile})
	require.NoError(t, err)
	cert, err := kp.GetCertificate(nil)
	require.NoError(t, err)
	require.NotNil(t, cert.Leaf)
	assert.Equal(t, []string{"broker.example"}, cert.Leaf.DNSNames)
}
