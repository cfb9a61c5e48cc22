package identity

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/utils/clock"
)

// DefaultInterval is how often FileSource and KeyPairFile read their files
// when no interval is given.
const DefaultInterval = 5 * time.Second

// loadRetryInterval is how often a first load that failed reads the files
// again, unless the poll interval is shorter.
const loadRetryInterval = 100 * time.Millisecond

// filePoller reads a fixed set of files every interval and, when their
// contents differ from the last read, hands them to apply. It compares
// contents rather than watching paths, so it sees every kind of update: an
// in-place write, a rename over the file, or Kubernetes' swap of the ..data
// symlink behind a projected volume.
//
// A failed read or apply leaves whatever apply last stored in place; the
// failure is logged once, and the files are tried again when they change.
// New contents are applied only when two reads in a row agree, so a read
// that straddles an atomic update of several files is never applied. Files
// rewritten in place one by one can still be caught half-way, such as a new
// certificate with the old key: that fails to apply, is logged, and heals at
// the next poll.
type filePoller struct {
	files    []string
	interval time.Duration
	clock    clock.WithTicker
	log      logr.Logger
	// apply parses contents (one entry per file, in order) and, when they
	// are good, stores the result. It returns key-value pairs describing
	// what it stored, for the log.
	apply func(contents [][]byte) (logValues []any, err error)
	// readFile reads one file: os.ReadFile, or in tests a reader that
	// changes the files between reads.
	readFile func(name string) ([]byte, error)

	mu          sync.Mutex
	last        [sha256.Size]byte // digest of the contents last applied, good or bad
	lastReadErr string            // the last read or load error logged, to log each only once
}

func newFilePoller(files []string, interval time.Duration, log logr.Logger, apply func([][]byte) ([]any, error)) (*filePoller, error) {
	for i, f := range files {
		if f == "" {
			return nil, fmt.Errorf("identity: file %d of %d has no name", i+1, len(files))
		}
	}
	switch {
	case interval == 0:
		interval = DefaultInterval
	case interval < 0:
		return nil, fmt.Errorf("identity: interval %v is negative", interval)
	}
	return &filePoller{files: files, interval: interval, clock: clock.RealClock{}, log: log, apply: apply, readFile: os.ReadFile}, nil
}

// load reads and applies the files, and reads them again while they fail,
// every loadRetryInterval (or the poll interval when it is shorter), until
// wait (DefaultWait when not positive) has passed or ctx ends; then it
// returns the last failure. A writer
// that replaces a certificate and its key one after the other (by hand, or a
// tool that does not swap them atomically) leaves a pair that does not match
// for a moment, and a process that gave up on it at start would turn that
// moment into a crash loop. Each distinct failure is logged once.
func (p *filePoller) load(ctx context.Context, wait time.Duration) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if wait <= 0 {
		wait = DefaultWait
	}
	retry := min(p.interval, loadRetryInterval)
	start := p.clock.Now()
	deadline := start.Add(wait)
	for tries := 1; ; tries++ {
		err := p.loadOnce()
		if err == nil {
			if tries > 1 {
				p.log.Info("loaded credential files after retrying", "files", p.files, "tries", tries)
			}
			return nil
		}
		if !p.clock.Now().Before(deadline) {
			return fmt.Errorf("%w (still so after trying for %v)", err, wait)
		}
		if msg := err.Error(); msg != p.lastReadErr {
			p.lastReadErr = msg
			p.log.Error(err, "cannot load credential files yet, reading them again", "files", p.files, "for", wait)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (stopped trying: %w)", err, context.Cause(ctx))
		case <-p.clock.After(retry):
		}
	}
}

// loadOnce reads the files until two reads in a row agree, at most three
// times, and applies them.
func (p *filePoller) loadOnce() error {
	for range 3 {
		contents, err := p.read()
		if err != nil {
			return err
		}
		d := digest(contents)
		if !p.unchangedSince(d) {
			continue // being updated; read again
		}
		if _, err := p.apply(contents); err != nil {
			return err
		}
		p.last, p.lastReadErr = d, ""
		return nil
	}
	return fmt.Errorf("identity: %v kept changing while being read", p.files)
}

// run polls until ctx is done, then returns nil.
func (p *filePoller) run(ctx context.Context) error {
	t := p.clock.NewTicker(p.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C():
			p.poll()
		}
	}
}

func (p *filePoller) poll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	contents, err := p.read()
	if err != nil {
		p.logReadError(err)
		return
	}
	d := digest(contents)
	if d == p.last {
		p.lastReadErr = ""
		return
	}
	// The files changed. Make sure this read did not straddle an update of
	// several of them; if it did, the next poll reads the settled files.
	if !p.unchangedSince(d) {
		return
	}
	p.lastReadErr = ""
	p.last = d
	kv, err := p.apply(contents)
	if err != nil {
		p.log.Error(err, "cannot reload credential files, keeping the loaded credentials", "files", p.files)
		return
	}
	p.log.Info("reloaded credential files", append([]any{"files", p.files}, kv...)...)
}

// unchangedSince reads the files again and reports whether their digest is
// still d. Files are read one after another, so one read can mix old and new
// files when they are updated meanwhile, such as a certificate and key from
// before the kubelet swaps a volume's ..data symlink and a bundle from after.
// Any file of such a read that was new is new in the next read too, so two
// equal reads in a row are consistent.
func (p *filePoller) unchangedSince(d [sha256.Size]byte) bool {
	again, err := p.read()
	return err == nil && digest(again) == d
}

// logReadError logs err unless it is the same as the last one logged.
func (p *filePoller) logReadError(err error) {
	if msg := err.Error(); msg != p.lastReadErr {
		p.lastReadErr = msg
		p.log.Error(err, "cannot read credential files, keeping the loaded credentials", "files", p.files)
	}
}

func (p *filePoller) read() ([][]byte, error) {
	contents := make([][]byte, len(p.files))
	for i, f := range p.files {
		b, err := p.readFile(f)
		if err != nil {
			return nil, fmt.Errorf("identity: %w", err)
		}
		contents[i] = b
	}
	return contents, nil
}

// digest hashes contents so that no two different lists collide by
// moving bytes from one file to the next. It keeps the poller from holding a
// second copy of a private key.
func digest(contents [][]byte) [sha256.Size]byte {
	h := sha256.New()
	var n [8]byte
	for _, c := range contents {
		binary.BigEndian.PutUint64(n[:], uint64(len(c)))
		h.Write(n[:])
		h.Write(c)
	}
	var d [sha256.Size]byte
	h.Sum(d[:0])
	return d
}
