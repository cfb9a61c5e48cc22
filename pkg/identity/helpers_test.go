package identity_test

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/stretchr/testify/require"

	"github.com/credbroker/credbroker/internal/testing/testpki"
)

// pollInterval keeps reload tests quick; they wait with require.Eventually.
const pollInterval = 10 * time.Millisecond

// failWait bounds how long a test's NewFileSource or NewKeyPairFile reads
// files that will not load before it fails.
const failWait = 50 * time.Millisecond

// projectedDir mimics the kubelet's AtomicWriter, which fills secret and
// projected volumes: each file is a symlink through ..data, and an update
// writes a new hidden directory, renames a ..data_tmp symlink to it over
// ..data, and removes the old directory.
type projectedDir struct {
	t   *testing.T
	dir string
	gen int
	old string
}

func newProjectedDir(t *testing.T) *projectedDir {
	return &projectedDir{t: t, dir: t.TempDir()}
}

func (p *projectedDir) path(name string) string { return filepath.Join(p.dir, name) }

// write replaces the volume's contents with files, atomically.
func (p *projectedDir) write(files map[string][]byte) {
	t := p.t
	t.Helper()
	p.gen++
	gen := fmt.Sprintf("..gen_%d", p.gen)
	require.NoError(t, os.Mkdir(p.path(gen), 0o755))
	for name, data := range files {
		require.NoError(t, os.WriteFile(filepath.Join(p.dir, gen, name), data, 0o600))
	}
	require.NoError(t, os.Symlink(gen, p.path("..data_tmp")))
	require.NoError(t, os.Rename(p.path("..data_tmp"), p.path("..data")))
	for name := range files {
		if _, err := os.Lstat(p.path(name)); os.IsNotExist(err) {
			require.NoError(t, os.Symlink(filepath.Join("..data", name), p.path(name)))
		}
	}
	if p.old != "" {
		require.NoError(t, os.RemoveAll(p.path(p.old)))
	}
	p.old = gen
}

// svidFiles issues an SVID for id from ca and returns the files of a
// FileSource volume with the bundle of bundleCAs.
func svidFiles(t *testing.T, ca *testpki.CA, id string, bundleCAs ...*testpki.CA) map[string][]byte {
	t.Helper()
	certPEM, keyPEM, err := ca.IssueSVID(id, time.Hour)
	require.NoError(t, err)
	var bundle []byte
	for _, b := range bundleCAs {
		bundle = append(bundle, b.BundlePEM()...)
	}
	return map[string][]byte{"tls.crt": certPEM, "tls.key": keyPEM, "ca.crt": bundle}
}

func newCA(t *testing.T, td string) *testpki.CA {
	t.Helper()
	ca, err := testpki.NewCA(td)
	require.NoError(t, err)
	return ca
}

// logRecorder is a logr sink that keeps what was logged, so a test can wait
// for a reload attempt without guessing how long it takes.
type logRecorder struct {
	mu     sync.Mutex
	errors []error
	infos  []string // each message with its key/value pairs, at any level
}

func (r *logRecorder) logger() logr.Logger { return logr.New(recorderSink{r}) }

func (r *logRecorder) errorCount() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.errors)
}

// hasError reports whether an error containing substr was logged.
func (r *logRecorder) hasError(substr string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, err := range r.errors {
		if strings.Contains(err.Error(), substr) {
			return true
		}
	}
	return false
}

// hasInfo reports whether an info line containing substr was logged.
func (r *logRecorder) hasInfo(substr string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.ContainsFunc(r.infos, func(l string) bool { return strings.Contains(l, substr) })
}

// waitForError waits until the poller has logged an error containing substr.
func waitForError(t *testing.T, r *logRecorder, substr string) {
	t.Helper()
	require.Eventually(t, func() bool { return r.hasError(substr) }, 5*time.Second, pollInterval,
		"no error containing %q was logged", substr)
}

type recorderSink struct{ r *logRecorder }

func (recorderSink) Init(logr.RuntimeInfo)  {}
func (recorderSink) Enabled(level int) bool { return true }
func (s recorderSink) Info(_ int, msg string, kv ...any) {
	s.r.mu.Lock()
	defer s.r.mu.Unlock()
	s.r.infos = append(s.r.infos, strings.TrimSpace(fmt.Sprintln(append([]any{msg}, kv...)...)))
}
func (s recorderSink) Error(err error, _ string, _ ...any) {
	s.r.mu.Lock()
	defer s.r.mu.Unlock()
	s.r.errors = append(s.r.errors, err)
}
func (s recorderSink) WithValues(...any) logr.LogSink { return s }
func (s recorderSink) WithName(string) logr.LogSink   { return s }
