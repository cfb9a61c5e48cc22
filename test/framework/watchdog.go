package framework

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"runtime"
	"time"
)

// StuckReportMargin is how long before the test binary's -timeout
// WatchStuckTests reports.
const StuckReportMargin = 90 * time.Second

// WatchStuckTests starts a watchdog for a suite run under -timeout (call
// flag.Parse first, in TestMain): a
// margin before the timeout ends the binary, it writes to w the stacks of
// the goroutines that run test code (a frame in a _test.go file), and
// nothing else. Go's own timeout panic prints every goroutine, and a CI log
// that keeps only its last lines loses the stuck test among the informers'
// watches; this report, written last, names it. The returned func stops
// the watchdog.
func WatchStuckTests(w io.Writer) (stop func()) {
	f := flag.Lookup("test.timeout")
	if f == nil {
		return func() {}
	}
	timeout, ok := f.Value.(flag.Getter).Get().(time.Duration)
	if !ok || timeout <= 2*StuckReportMargin {
		return func() {}
	}
	timer := time.AfterFunc(timeout-StuckReportMargin, func() {
		fmt.Fprintf(w, "\n=== STUCK: the suite is still running %s before its -timeout of %s; the goroutines in test code:\n\n",
			StuckReportMargin, timeout)
		_, _ = w.Write(TestGoroutines())
	})
	return func() { timer.Stop() }
}

// TestGoroutines returns the stacks of every goroutine with a frame in a
// _test.go file, separated by blank lines.
func TestGoroutines() []byte {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	var out bytes.Buffer
	for g := range bytes.SplitSeq(buf, []byte("\n\n")) {
		if bytes.Contains(g, []byte("_test.go:")) {
			out.Write(g)
			out.WriteString("\n\n")
		}
	}
	return out.Bytes()
}
