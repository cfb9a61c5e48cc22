package framework_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/credbroker/credbroker/test/framework"
)

// fatalRecorder is a test whose Fatal is recorded rather than ending it.
type fatalRecorder struct {
	*testing.T
	fatal string
}

func (r *fatalRecorder) Fatal(args ...any) { r.fatal = fmt.Sprint(args...) }

// A wait that times out says what it waited for, what its condition saw
// last, and the last lines of the processes it names.
func TestEventuallyReportsWhatItSawLast(t *testing.T) {
	p, err := framework.StartProcess("/bin/sh", "-c", "echo one; echo two; echo three; exec sleep 60")
	require.NoError(t, err)
	t.Cleanup(p.Stop)
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Contains(c, p.Output(), "three") }, 10*time.Second, 10*time.Millisecond)

	rec := &fatalRecorder{T: t}
	calls := 0
	framework.Eventually(rec, 200*time.Millisecond, 10*time.Millisecond, "the count to reach 1000", func(c assert.TestingT) {
		calls++
		assert.Equal(c, 1000, calls, "the count")
	}, p)
	assert.Contains(t, rec.fatal, "waiting for the count to reach 1000: context deadline exceeded")
	assert.Contains(t, rec.fatal, fmt.Sprintf("actual  : %d", calls), "the last call's assertion")
	assert.Contains(t, rec.fatal, "the count")
	assert.Contains(t, rec.fatal, "lines of sh (pid ")
	assert.Contains(t, rec.fatal, "one\ntwo\nthree")

	calls = 0
	took := framework.Eventually(t, 10*time.Second, time.Millisecond, "the third call", func(c assert.TestingT) {
		calls++
		assert.GreaterOrEqual(c, calls, 3)
	})
	assert.Equal(t, 3, calls)
	assert.Positive(t, took)
}

func TestLastLines(t *testing.T) {
	for _, tt := range []struct {
		text string
		n    int
		want string
	}{
		{"a\nb\nc\n", 2, "b\nc"},
		{"a\nb\nc", 3, "a\nb\nc"},
		{"a\nb\nc", 5, "a\nb\nc"},
		{"a\nb\nc", 0, ""},
		{"", 3, ""},
	} {
		assert.Equal(t, tt.want, framework.LastLines(tt.text, tt.n), "last %d lines of %q", tt.n, tt.text)
	}
}
