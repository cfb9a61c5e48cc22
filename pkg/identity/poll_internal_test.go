package identity

import (
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// rotatingFiles serves files named like "cert" as "cert-<generation>", and
// moves every file to the next generation at once (an atomic update, such
// as the kubelet's swap of a projected volume's ..data symlink) after the
// file reads for which rotateAfter says so.
type rotatingFiles struct {
	mu          sync.Mutex
	gen         int
	reads       int
	rotateAfter func(read int) bool
}

func (r *rotatingFiles) readFile(name string) ([]byte, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.reads++
	b := []byte(fmt.Sprintf("%s-%d", filepath.Base(name), r.gen))
	if r.rotateAfter != nil && r.rotateAfter(r.reads) {
		r.gen++
	}
	return b, nil
}

// rotateAfterRead rotates the files once, after the nth file read from
// now (counting from 1).
func (r *rotatingFiles) rotateAfterRead(n int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	at := r.reads + n
	r.rotateAfter = func(read int) bool { return read == at }
}

// newRotatingPoller polls a certificate and its key, served by files, and
// records what it applies.
func newRotatingPoller(t *testing.T, files *rotatingFiles) (*filePoller, func() []string) {
	t.Helper()
	var mu sync.Mutex
	var applied []string
	p, err := newFilePoller([]string{"/creds/cert", "/creds/key"}, 0, logr.Discard(), func(contents [][]byte) ([]any, error) {
		mu.Lock()
		defer mu.Unlock()
		applied = append(applied, string(contents[0])+"+"+string(contents[1]))
		return nil, nil
	})
	require.NoError(t, err)
	p.readFile = files.readFile
	return p, func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), applied...)
	}
}

// Attack: the files are updated together while the poller reads them one
// after another, so one read holds the old certificate and the new key (or
// an old SVID with a new bundle). Applied, that pair serves nothing or, with
// a bundle, trusts what it should not.
// Defence: contents are applied only when two reads in a row agree.
func TestPollerNeverAppliesAReadThatStraddlesAnUpdate(t *testing.T) {
	t.Run("load", func(t *testing.T) {
		files := &rotatingFiles{gen: 1}
		p, applied := newRotatingPoller(t, files)
		files.rotateAfterRead(1) // between the cert and the key of the first read
		require.NoError(t, p.load(t.Context(), 0))
		assert.Equal(t, []string{"cert-2+key-2"}, applied())
	})

	t.Run("load of files that keep changing", func(t *testing.T) {
		files := &rotatingFiles{gen: 1, rotateAfter: func(read int) bool { return read%2 == 1 }} // after every cert
		p, applied := newRotatingPoller(t, files)
		err := p.load(t.Context(), time.Millisecond)
		require.Error(t, err)
		assert.Contains(t, err.Error(), "kept changing while being read")
		assert.Empty(t, applied())
	})

	t.Run("poll", func(t *testing.T) {
		files := &rotatingFiles{gen: 1}
		p, applied := newRotatingPoller(t, files)
		require.NoError(t, p.load(t.Context(), 0))
		require.Equal(t, []string{"cert-1+key-1"}, applied())

		files.rotateAfterRead(1)
		p.poll()
		assert.Equal(t, []string{"cert-1+key-1"}, applied(), "a read of the old cert with the new key was applied")
		p.poll()
		assert.Equal(t, []string{"cert-1+key-1", "cert-2+key-2"}, applied(), "the settled files are applied at the next poll")
		p.poll()
		assert.Equal(t, []string{"cert-1+key-1", "cert-2+key-2"}, applied(), "unchanged files are not applied again")
	})
}
