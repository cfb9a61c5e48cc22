package identity_test

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/credbroker/credbroker/internal/testing/testpki"
	"github.com/credbroker/credbroker/pkg/identity"
)

// tornPairWriter rotates a certificate and its key between two pairs, a
// and b, the way a writer that replaces the two files one after the other
// does: the certificate first, then, after torn, the key. Each file is
// replaced whole; for torn of every 2×torn the files hold the certificate
// of one pair and the key of the other.
type tornPairWriter struct {
	certFile, keyFile string
	certs, keys       [2][]byte
	torn              time.Duration
}

// run rotates until ctx ends.
func (w *tornPairWriter) run(ctx context.Context, t *testing.T) {
	for i := 1; ctx.Err() == nil; i++ {
		for _, step := range []struct {
			file string
			data []byte
		}{{w.certFile, w.certs[i%2]}, {w.keyFile, w.keys[i%2]}} {
			if err := testpki.WriteFileAtomic(step.file, step.data, 0o600); err != nil {
				t.Errorf("tornPairWriter: %v", err)
				return
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(w.torn):
			}
		}
	}
}

// Attack (a write race, not a person): the SVID's certificate and key are
// replaced one after the other, by hand or by a tool that does not swap
// them atomically, while an agent or a broker starts. A start that reads
// the certificate of one pair and the key of the other failed, and the
// process exited: a crash loop made of a write race (it failed CI when
// two test agents shared their SVID files).
// Defence: the first load logs the failure and reads the files again,
// for up to Wait, instead of giving up at once.
func TestFirstLoadWaitsOutATornPair(t *testing.T) {
	ca := newCA(t, "example.test")
	dir := t.TempDir()
	certFile, keyFile, bundleFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"), filepath.Join(dir, "ca.crt")
	require.NoError(t, os.WriteFile(bundleFile, ca.BundlePEM(), 0o600))

	loaders := map[string]struct {
		issue func() (certPEM, keyPEM []byte)
		load  func(ctx context.Context, logs *logRecorder) error
	}{
		"FileSource": {
			issue: func() ([]byte, []byte) {
				f := svidFiles(t, ca, agentID, ca)
				return f["tls.crt"], f["tls.key"]
			},
			load: func(ctx context.Context, logs *logRecorder) error {
				_, err := identity.NewFileSource(ctx, identity.FileSourceConfig{
					CertFile: certFile, KeyFile: keyFile, BundleFile: bundleFile, TrustDomain: td,
					Interval: pollInterval, Wait: 30 * time.Second, Log: logs.logger(),
				})
				return err
			},
		},
		"KeyPairFile": {
			issue: func() ([]byte, []byte) {
				certPEM, keyPEM, err := ca.IssueServing([]string{"broker.example"}, time.Hour)
				require.NoError(t, err)
				return certPEM, keyPEM
			},
			load: func(ctx context.Context, logs *logRecorder) error {
				_, err := identity.NewKeyPairFile(ctx, identity.KeyPairFileConfig{
					CertFile: certFile, KeyFile: keyFile, Interval: pollInterval, Wait: 30 * time.Second, Log: logs.logger(),
				})
				return err
			},
		},
	}
	for name, l := range loaders {
		t.Run(name, func(t *testing.T) {
			w := &tornPairWriter{certFile: certFile, keyFile: keyFile, torn: 20 * time.Millisecond}
			for i := range 2 {
				w.certs[i], w.keys[i] = l.issue()
			}
			require.NoError(t, testpki.WriteFileAtomic(certFile, w.certs[0], 0o600))
			require.NoError(t, testpki.WriteFileAtomic(keyFile, w.keys[0], 0o600))
			ctx, cancel := context.WithCancel(t.Context())
			var wg sync.WaitGroup
			wg.Go(func() { w.run(ctx, t) })
			defer wg.Wait()
			defer cancel()

			// Start until three starts have met a torn pair. Without the
			// retry, the first of them fails.
			logs := &logRecorder{}
			for starts := 0; logs.errorCount() < 3; starts++ {
				require.Less(t, starts, 1000, "no start met a torn pair three times; the test proves nothing")
				require.NoError(t, l.load(ctx, logs), "start %d", starts)
			}
			assert.True(t, logs.hasError("does not match"), "the starts met something other than a torn pair")
		})
	}
}

// A first load that never succeeds ends at Wait, or at once when its
// context ends, with the reason it failed.
func TestFirstLoadGivesUp(t *testing.T) {
	ca := newCA(t, "example.test")
	dir := t.TempDir()
	files := svidFiles(t, ca, agentID, ca)
	files["tls.key"] = svidFiles(t, ca, agentID, ca)["tls.key"]
	for name, data := range files {
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), data, 0o600))
	}
	cfg := identity.FileSourceConfig{
		CertFile: filepath.Join(dir, "tls.crt"), KeyFile: filepath.Join(dir, "tls.key"), BundleFile: filepath.Join(dir, "ca.crt"),
		TrustDomain: td, Interval: pollInterval, Wait: 5 * pollInterval,
	}
	logs := &logRecorder{}
	cfg.Log = logs.logger()
	_, err := identity.NewFileSource(t.Context(), cfg)
	require.ErrorContains(t, err, "leaf certificate does not match private key (still so after trying for 50ms)")
	assert.Equal(t, 1, logs.errorCount(), "each failure is logged once, not at every retry")

	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	cfg.Wait = time.Hour
	_, err = identity.NewFileSource(ctx, cfg)
	require.ErrorContains(t, err, "leaf certificate does not match private key (stopped trying: context canceled)")
	require.ErrorIs(t, err, context.Canceled)
}
