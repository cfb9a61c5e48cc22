package cmdflags

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clocktesting "k8s.io/utils/clock/testing"
)

// recorder is an io.WriteCloser that keeps each write apart.
type recorder struct {
	mu     sync.Mutex
	writes []string
	closed bool
	err    error
}

func (r *recorder) Write(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.err != nil {
		return 0, r.err
	}
	r.writes = append(r.writes, string(p))
	return len(p), nil
}

func (r *recorder) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.closed = true
	return nil
}

func (r *recorder) all() (string, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return strings.Join(r.writes, ""), len(r.writes)
}

func TestBatchWriter(t *testing.T) {
	line := func(i int) []byte { return fmt.Appendf(nil, "{\"n\":%d}\n", i) }
	tests := []struct {
		name string
		// act writes and returns the lines that must have reached next,
		// in order, and how many writes next may have taken at most.
		act func(t *testing.T, w *batchWriter, clk *clocktesting.FakeClock, next *recorder) (want string, maxWrites int)
	}{
		{"held until a tick", func(t *testing.T, w *batchWriter, clk *clocktesting.FakeClock, next *recorder) (string, int) {
			for i := range 3 {
				_, err := w.Write(line(i))
				require.NoError(t, err)
			}
			got, _ := next.all()
			assert.Empty(t, got, "nothing is written before the interval")
			clk.Step(BatchInterval)
			want := string(line(0)) + string(line(1)) + string(line(2))
			require.Eventually(t, func() bool { got, _ := next.all(); return got == want }, 10*time.Second, time.Millisecond)
			return want, 1
		}},
		{"written at the size", func(t *testing.T, w *batchWriter, _ *clocktesting.FakeClock, next *recorder) (string, int) {
			big := bytes.Repeat([]byte("x"), BatchSize-1)
			big = append(big, '\n')
			_, err := w.Write(big)
			require.NoError(t, err)
			got, _ := next.all()
			assert.Equal(t, string(big), got, "a full buffer is written in the Write that filled it")
			return string(big), 1
		}},
		{"written on close", func(t *testing.T, w *batchWriter, _ *clocktesting.FakeClock, next *recorder) (string, int) {
			_, err := w.Write(line(7))
			require.NoError(t, err)
			require.NoError(t, w.Close())
			assert.True(t, next.closed)
			_, err = w.Write(line(8))
			require.ErrorIs(t, err, errClosed)
			return string(line(7)), 1
		}},
		{"concurrent writers, every line whole and once", func(t *testing.T, w *batchWriter, clk *clocktesting.FakeClock, next *recorder) (string, int) {
			var wg sync.WaitGroup
			for g := range 8 {
				wg.Go(func() {
					for i := range 500 {
						_, _ = w.Write(line(g*1000 + i))
						if i%100 == 0 {
							clk.Step(BatchInterval)
						}
					}
				})
			}
			wg.Wait()
			require.NoError(t, w.Close())
			got, _ := next.all()
			seen := map[string]bool{}
			for l := range strings.SplitSeq(strings.TrimSuffix(got, "\n"), "\n") {
				assert.False(t, seen[l], "line %s twice", l)
				seen[l] = true
			}
			for g := range 8 {
				for i := range 500 {
					assert.True(t, seen[strings.TrimSuffix(string(line(g*1000+i)), "\n")])
				}
			}
			return got, 4000
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clk := clocktesting.NewFakeClock(time.Unix(0, 0))
			next := &recorder{}
			w := NewBatchWriter(next, clk, BatchInterval).(*batchWriter)
			want, maxWrites := tt.act(t, w, clk, next)
			_ = w.Close()
			got, writes := next.all()
			assert.Equal(t, want, got)
			assert.LessOrEqual(t, writes, maxWrites)
		})
	}
}

// A failed write to the file is returned by the next Write, and by Close
// if no Write came after it.
func TestBatchWriterErrors(t *testing.T) {
	clk := clocktesting.NewFakeClock(time.Unix(0, 0))
	next := &recorder{err: errors.New("disk full")}
	w := NewBatchWriter(next, clk, BatchInterval)
	_, err := w.Write([]byte("a\n"))
	require.NoError(t, err)
	require.ErrorContains(t, w.Close(), "disk full")
}

func TestAuditLogModeFlag(t *testing.T) {
	dir := t.TempDir()
	a := AuditFlags{Path: dir + "/audit.log", MaxSize: 1, Mode: AuditBatch}
	w, err := a.Open()
	require.NoError(t, err)
	_, ok := w.(*batchWriter)
	assert.True(t, ok, "%T", w)
	log := AuditLogger(w)
	log.Info("exchange", "code", "OK")
	require.NoError(t, w.Close())
	raw, err := os.ReadFile(a.Path)
	data := string(raw)
	require.NoError(t, err)
	assert.Contains(t, data, `"code":"OK"`, "Close writes the batch")

	a.Mode = "lazy"
	_, err = a.Open()
	require.ErrorContains(t, err, `--audit-log-mode "lazy" is neither "blocking" nor "batch"`)
}
