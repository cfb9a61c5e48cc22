package cmdflags

import (
	"errors"
	"io"
	"sync"
	"time"

	"k8s.io/utils/clock"
)

// The audit log's write modes (--audit-log-mode).
const (
	// AuditBlocking writes each line to the file before the call that
	// logged it returns: a crash loses no line that was logged.
	AuditBlocking = "blocking"
	// AuditBatch buffers lines and writes them every BatchInterval, when
	// BatchSize bytes are waiting, and on Close: one write(2) for many
	// lines, at the cost of the lines of the last BatchInterval on a crash.
	AuditBatch = "batch"
)

const (
	// BatchInterval is how often a batch audit writer writes its lines.
	BatchInterval = 100 * time.Millisecond
	// BatchSize is how many buffered bytes make a batch audit writer
	// write at once.
	BatchSize = 256 << 10
)

// errClosed is returned by a batchWriter's Write after Close.
var errClosed = errors.New("audit log is closed")

// batchWriter buffers whole writes (the JSON handler writes one line per
// Write) and passes them to next in order, many at a time: when BatchSize
// bytes are waiting, every interval of its clock, and on Close, which
// writes what is left and closes next. A write is never split, so a line
// is never split across a rotation of next.
type batchWriter struct {
	next io.WriteCloser

	// mu guards buf, err and closed; flushMu orders the writes to next, so
	// that Write can fill a new buffer while the last one is written.
	mu      sync.Mutex
	buf     []byte
	spare   []byte
	err     error // the first failed write to next
	closed  bool
	flushMu sync.Mutex

	stop chan struct{}
	done chan struct{}
}

// NewBatchWriter returns a writer that batches its writes to next, as
// --audit-log-mode=batch does, writing every interval of clk. Close it to
// write the rest.
func NewBatchWriter(next io.WriteCloser, clk clock.WithTicker, interval time.Duration) io.WriteCloser {
	w := &batchWriter{next: next, buf: make([]byte, 0, BatchSize), spare: make([]byte, 0, BatchSize),
		stop: make(chan struct{}), done: make(chan struct{})}
	ticker := clk.NewTicker(interval)
	go func() {
		defer close(w.done)
		defer ticker.Stop()
		for {
			select {
			case <-ticker.C():
				w.flush()
			case <-w.stop:
				return
			}
		}
	}()
	return w
}

// Write buffers p, and writes the buffer when it has reached BatchSize. It
// returns the error of an earlier failed write to next, if any, once.
func (w *batchWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return 0, errClosed
	}
	w.buf = append(w.buf, p...)
	full := len(w.buf) >= BatchSize
	err := w.err
	w.err = nil
	w.mu.Unlock()
	if full {
		w.flush()
	}
	return len(p), err
}

// flush writes what is buffered to next.
func (w *batchWriter) flush() {
	w.flushMu.Lock()
	defer w.flushMu.Unlock()
	w.mu.Lock()
	out := w.buf
	w.buf, w.spare = w.spare[:0], nil
	w.mu.Unlock()
	if len(out) > 0 {
		if _, err := w.next.Write(out); err != nil {
			w.mu.Lock()
			if w.err == nil {
				w.err = err
			}
			w.mu.Unlock()
		}
	}
	w.mu.Lock()
	w.spare = out[:0]
	w.mu.Unlock()
}

// Close writes what is buffered, stops the timer and closes next. It
// returns the first write error not yet returned, or next's Close error.
func (w *batchWriter) Close() error {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return errClosed
	}
	w.closed = true
	w.mu.Unlock()
	close(w.stop)
	<-w.done
	w.flush()
	w.mu.Lock()
	err := w.err
	w.mu.Unlock()
	return errors.Join(err, w.next.Close())
}
