package identity_test

import (
	"context"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/credbroker/credbroker/internal/testing/testpki"
	"github.com/credbroker/credbroker/pkg/identity"
)

const agentID = "spiffe://example.test/clusterprofile/ns/name"

var td = spiffeid.RequireTrustDomainFromString("example.test")

func TestNewFileSource(t *testing.T) {
	ca := newCA(t, "example.test")
	otherCA := newCA(t, "other.test")
	good := svidFiles(t, ca, agentID, ca)
	withFile := func(name string, data []byte) map[string][]byte {
		m := map[string][]byte{}
		for k, v := range good {
			m[k] = v
		}
		if data == nil {
			delete(m, name)
		} else {
			m[name] = data
		}
		return m
	}
	garbage := []byte("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n")

	tests := []struct {
		name     string
		files    map[string][]byte
		noTD     bool
		interval time.Duration
		wantErr  string
	}{
		{name: "valid", files: good},
		{name: "bundle with several CAs", files: withFile("ca.crt", append(ca.BundlePEM(), otherCA.BundlePEM()...))},
		{name: "missing cert file", files: withFile("tls.crt", nil), wantErr: "tls.crt: no such file or directory"},
		{name: "missing key file", files: withFile("tls.key", nil), wantErr: "tls.key: no such file or directory"},
		{name: "missing bundle file", files: withFile("ca.crt", nil), wantErr: "ca.crt: no such file or directory"},
		{
			name:    "key does not match",
			files:   withFile("tls.key", svidFiles(t, ca, agentID, ca)["tls.key"]),
			wantErr: "leaf certificate does not match private key",
		},
		{
			name:    "SVID of another trust domain",
			files:   svidFiles(t, otherCA, "spiffe://other.test/clusterprofile/ns/name", ca),
			wantErr: "ID spiffe://other.test/clusterprofile/ns/name is not in trust domain example.test",
		},
		{name: "garbage cert", files: withFile("tls.crt", garbage), wantErr: "cannot parse PEM encoded certificate"},
		{name: "not PEM cert", files: withFile("tls.crt", []byte("hello")), wantErr: "cannot parse PEM encoded certificate"},
		{name: "garbage key", files: withFile("tls.key", []byte("hello")), wantErr: "cannot parse PEM encoded private key"},
		{name: "garbage bundle", files: withFile("ca.crt", garbage), wantErr: "ca.crt: x509bundle: cannot parse certificate"},
		{name: "empty bundle", files: withFile("ca.crt", []byte{}), wantErr: "ca.crt: no certificates"},
		{
			name:    "CA certificate as SVID",
			files:   withFile("tls.crt", ca.BundlePEM()),
			wantErr: "leaf certificate SPIFFE ID must have a non-root path",
		},
		{name: "no trust domain", files: good, noTD: true, wantErr: "identity: FileSourceConfig.TrustDomain is required"},
		{name: "negative interval", files: good, interval: -time.Second, wantErr: "identity: interval -1s is negative"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			for name, data := range tt.files {
				require.NoError(t, os.WriteFile(filepath.Join(dir, name), data, 0o600))
			}
			cfgTD := td
			if tt.noTD {
				cfgTD = spiffeid.TrustDomain{}
			}
			src, err := identity.NewFileSource(t.Context(), identity.FileSourceConfig{
				CertFile:    filepath.Join(dir, "tls.crt"),
				KeyFile:     filepath.Join(dir, "tls.key"),
				BundleFile:  filepath.Join(dir, "ca.crt"),
				TrustDomain: cfgTD,
				Interval:    tt.interval,
				Wait:        failWait,
			})
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				assert.Nil(t, src)
				return
			}
			require.NoError(t, err)

			svid, err := src.GetX509SVID()
			require.NoError(t, err)
			assert.Equal(t, agentID, svid.ID.String())

			bundle, err := src.GetX509BundleForTrustDomain(td)
			require.NoError(t, err)
			assert.Equal(t, td, bundle.TrustDomain())
			assert.True(t, bundle.HasX509Authority(ca.Certificate()))

			_, err = src.GetX509BundleForTrustDomain(spiffeid.RequireTrustDomainFromString("other.test"))
			require.EqualError(t, err, `identity: no X.509 bundle for trust domain "other.test"`)
		})
	}
}

func TestNewFileSourceMissingConfig(t *testing.T) {
	_, err := identity.NewFileSource(t.Context(), identity.FileSourceConfig{CertFile: "a", KeyFile: "b", TrustDomain: td})
	require.EqualError(t, err, "identity: FileSourceConfig needs CertFile, KeyFile and BundleFile")
}

func TestFileSourceReload(t *testing.T) {
	ca := newCA(t, "example.test")
	vol := newProjectedDir(t)
	vol.write(svidFiles(t, ca, agentID, ca))
	src, logs, first := runFileSource(t, vol.path("tls.crt"), vol.path("tls.key"), vol.path("ca.crt"))
	var changes atomic.Int32
	src.OnChange(func() { changes.Add(1) })

	// Rotate to an SVID from a new CA, with a bundle that trusts both.
	nextCA := newCA(t, "example.test")
	vol.write(svidFiles(t, nextCA, agentID, ca, nextCA))
	var rotated []byte
	require.Eventually(t, func() bool {
		svid, err := src.GetX509SVID()
		require.NoError(t, err)
		rotated = svid.Certificates[0].Raw
		return svid.Certificates[0].SerialNumber.Cmp(first.Certificates[0].SerialNumber) != 0
	}, 5*time.Second, pollInterval)
	bundle, err := src.GetX509BundleForTrustDomain(td)
	require.NoError(t, err)
	assert.True(t, bundle.HasX509Authority(ca.Certificate()))
	assert.True(t, bundle.HasX509Authority(nextCA.Certificate()))
	require.Eventually(t, func() bool { return changes.Load() == 1 }, 5*time.Second, pollInterval, "OnChange is told of the rotation")
	// No assertion on the error log here: a poll that reads the certificate
	// before the swap and the key after it fails once, by design.

	// A broken update is logged and the rotated SVID stays.
	broken := svidFiles(t, nextCA, agentID, nextCA)
	broken["tls.key"] = svidFiles(t, nextCA, agentID, nextCA)["tls.key"]
	vol.write(broken)
	waitForError(t, logs, "leaf certificate does not match private key")
	svid, err := src.GetX509SVID()
	require.NoError(t, err)
	assert.Equal(t, rotated, svid.Certificates[0].Raw)
	bundle, err = src.GetX509BundleForTrustDomain(td)
	require.NoError(t, err)
	assert.True(t, bundle.HasX509Authority(ca.Certificate()), "the bundle stays with the SVID")
	assert.EqualValues(t, 1, changes.Load(), "a failed reload changes nothing")

	// An SVID that moved to another trust domain is refused too.
	otherCA := newCA(t, "other.test")
	vol.write(svidFiles(t, otherCA, "spiffe://other.test/clusterprofile/ns/name", otherCA))
	waitForError(t, logs, "is not in trust domain example.test")
	svid, err = src.GetX509SVID()
	require.NoError(t, err)
	assert.Equal(t, rotated, svid.Certificates[0].Raw)

	// A good update after failures is picked up again.
	vol.write(svidFiles(t, nextCA, "spiffe://example.test/clusterprofile/ns/renamed", nextCA))
	require.Eventually(t, func() bool {
		svid, err := src.GetX509SVID()
		require.NoError(t, err)
		return svid.ID.Path() == "/clusterprofile/ns/renamed"
	}, 5*time.Second, pollInterval)
}

func TestFileSourceReloadInPlace(t *testing.T) {
	// Plain files rewritten in place, not a projected volume. A missing file
	// is a read failure that keeps the loaded SVID.
	ca := newCA(t, "example.test")
	dir := t.TempDir()
	// write rewrites the certificate and key in place, then renames the
	// bundle into place: until then reads fail on the missing bundle, so no
	// poll sees a half-written pair.
	write := func(files map[string][]byte) {
		require.NoError(t, os.WriteFile(filepath.Join(dir, "tls.crt"), files["tls.crt"], 0o600))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "tls.key"), files["tls.key"], 0o600))
		require.NoError(t, testpki.WriteFileAtomic(filepath.Join(dir, "ca.crt"), files["ca.crt"], 0o600))
	}
	write(svidFiles(t, ca, agentID, ca))
	src, logs, first := runFileSource(t, filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"), filepath.Join(dir, "ca.crt"))

	require.NoError(t, os.Remove(filepath.Join(dir, "ca.crt")))
	waitForError(t, logs, "ca.crt: no such file or directory")
	svid, err := src.GetX509SVID()
	require.NoError(t, err)
	assert.Same(t, first, svid)

	write(svidFiles(t, ca, "spiffe://example.test/clusterprofile/ns/next", ca))
	require.Eventually(t, func() bool {
		svid, err := src.GetX509SVID()
		require.NoError(t, err)
		return svid.ID.Path() == "/clusterprofile/ns/next"
	}, 5*time.Second, pollInterval)
	assert.Equal(t, 1, logs.errorCount(), "a read failure is logged once")
}

// runFileSource loads a FileSource from the three files, runs it until the
// test ends, and returns it with its log and the SVID it loaded first.
func runFileSource(t *testing.T, cert, key, bundle string) (*identity.FileSource, *logRecorder, *x509svid.SVID) {
	t.Helper()
	logs := &logRecorder{}
	src, err := identity.NewFileSource(t.Context(), identity.FileSourceConfig{
		CertFile: cert, KeyFile: key, BundleFile: bundle,
		TrustDomain: td, Interval: pollInterval, Log: logs.logger(),
	})
	require.NoError(t, err)
	first, err := src.GetX509SVID()
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	return src, logs, first
}

// SVIDChanges reports a rotation of the SVID, not every change of the
// source: a new trust bundle alone makes the agent open no new streams.
func TestSVIDChangesIgnoresABundleChange(t *testing.T) {
	ca := newCA(t, "example.test")
	vol := newProjectedDir(t)
	files := svidFiles(t, ca, agentID, ca)
	vol.write(files)
	src, _, _ := runFileSource(t, vol.path("tls.crt"), vol.path("tls.key"), vol.path("ca.crt"))
	var rotations, changes atomic.Int32
	identity.SVIDChanges(src, func(*x509svid.SVID) { rotations.Add(1) })
	// Registered after SVIDChanges, so it runs after SVIDChanges' callback.
	src.OnChange(func() { changes.Add(1) })

	files["ca.crt"] = append(files["ca.crt"], newCA(t, "example.test").BundlePEM()...)
	vol.write(files)
	require.Eventually(t, func() bool { return changes.Load() == 1 }, 5*time.Second, pollInterval)
	assert.Zero(t, rotations.Load(), "a bundle change is not a rotation")

	vol.write(svidFiles(t, ca, agentID, ca))
	require.Eventually(t, func() bool { return changes.Load() == 2 }, 5*time.Second, pollInterval)
	assert.EqualValues(t, 1, rotations.Load())
}
