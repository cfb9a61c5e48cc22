package framework

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"k8s.io/apimachinery/pkg/util/wait"
)

// Eventually calls cond every tick until a call makes no failed assertion,
// and returns how long that took. cond states what must hold with assert
// calls on c, such as assert.Equal(c, 2, streams, "streams of %s", name),
// so that when timeout passes (or t's context ends) first, t fails with
// what, the assertions of cond's last call (the state it saw last) and the
// last lines of each of procs' output.
//
// Use it where require.EventuallyWithT does not fit: cond runs in the
// test's goroutine, so it may call require on t, and a call still running
// at the timeout finishes and counts, as with wait.PollUntilContextTimeout.
func Eventually(t testing.TB, timeout, tick time.Duration, what string, cond func(c assert.TestingT), procs ...*Process) time.Duration {
	t.Helper()
	start := time.Now()
	var last []string
	err := wait.PollUntilContextTimeout(t.Context(), tick, timeout, true, func(context.Context) (bool, error) {
		c := &collect{}
		cond(c)
		last = c.errs
		return len(last) == 0, nil
	})
	if err == nil {
		return time.Since(start)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "waiting for %s: %v after %s; last seen:\n%s", what, err,
		time.Since(start).Round(time.Millisecond), strings.Join(last, "\n"))
	for _, p := range procs {
		b.WriteString(p.TailContext(tailLines))
	}
	t.Fatal(b.String())
	return 0
}

// collect keeps the messages of the assertions that failed.
type collect struct{ errs []string }

func (c *collect) Errorf(format string, args ...any) {
	c.errs = append(c.errs, fmt.Sprintf(format, args...))
}

// tailLines is how many lines of a process's output a failed wait shows.
const tailLines = 20

// Tail returns the last n lines of what the process wrote so far.
func (p *Process) Tail(n int) string { return LastLines(p.Output(), n) }

// LastLines returns the last n lines of text, such as an in-process
// component's captured log, for the message of a wait that failed.
func LastLines(text string, n int) string {
	text = strings.TrimRight(text, "\n")
	if n <= 0 {
		return ""
	}
	end := len(text)
	for range n {
		i := strings.LastIndexByte(text[:end], '\n')
		if i < 0 {
			return text
		}
		end = i
	}
	return text[end+1:]
}

// TailContext returns the last n lines of the process's output, with the
// process's name and PID, formatted to follow an error message.
func (p *Process) TailContext(n int) string {
	tail := p.Tail(n)
	if tail == "" {
		tail = "(no output)"
	}
	return fmt.Sprintf("\nlast %d lines of %s (pid %d):\n%s", n, filepath.Base(p.cmd.Path), p.cmd.Process.Pid, tail)
}
