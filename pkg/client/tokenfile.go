package client

import (
	"context"
	"errors"
	"os"
	"sync"
	"time"

	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/pkg/brokerclient"
	"github.com/credbroker/credbroker/pkg/token"
)

// TokenSource gives the hub token (audience "credbroker") that the client
// sends to the broker. Token is called before every exchange; it must be
// safe for concurrent use.
type TokenSource interface {
	Token(ctx context.Context) (string, error)
}

// DefaultRereadInterval is how long a FileTokenSource keeps a token it read
// when RereadInterval is zero and the file has not changed.
const DefaultRereadInterval = time.Minute

// FileTokenSource reads the hub token from a projected ServiceAccount token
// file, which the kubelet rewrites as it rotates the token. It reads the
// file again when the file's size, modification time or identity changed
// (the kubelet swaps a symlink), after RereadInterval, and once the token
// it holds is past its exp claim; otherwise it answers from memory.
type FileTokenSource struct {
	path     string
	interval time.Duration
	clock    clock.PassiveClock

	mu     sync.Mutex
	token  string
	info   os.FileInfo
	readAt time.Time
	exp    time.Time // zero when the token has no readable exp
}

// NewFileTokenSource returns a FileTokenSource for path. A zero interval
// means DefaultRereadInterval; a nil clock, the real clock.
func NewFileTokenSource(path string, interval time.Duration, clk clock.PassiveClock) (*FileTokenSource, error) {
	if path == "" {
		return nil, errors.New("token file is required")
	}
	if interval < 0 {
		return nil, errors.New("reread interval is negative")
	}
	if interval == 0 {
		interval = DefaultRereadInterval
	}
	if clk == nil {
		clk = clock.RealClock{}
	}
	return &FileTokenSource{path: path, interval: interval, clock: clk}, nil
}

// Token returns the token in the file, read again when it may have changed.
// Errors name the file, never its content.
func (s *FileTokenSource) Token(context.Context) (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.clock.Now()
	info, statErr := os.Stat(s.path)
	if s.token != "" && statErr == nil && s.fresh(info, now) {
		return s.token, nil
	}
	tok, err := brokerclient.ReadToken(s.path)
	if err != nil {
		s.token = ""
		return "", err
	}
	s.token, s.info, s.readAt = tok, info, now
	s.exp, _ = token.Expiry(tok)
	return tok, nil
}

// fresh reports whether the token held, read at readAt, may still be used.
func (s *FileTokenSource) fresh(info os.FileInfo, now time.Time) bool {
	switch {
	case s.info == nil, !os.SameFile(s.info, info), s.info.Size() != info.Size(), !s.info.ModTime().Equal(info.ModTime()):
		return false
	case !now.Before(s.readAt.Add(s.interval)):
		return false
	case !s.exp.IsZero() && !now.Before(s.exp):
		return false
	}
	return true
}

// StaticTokenSource returns the same hub token every time; for tests and
// for callers that manage the token themselves.
type StaticTokenSource string

// Token returns s.
func (s StaticTokenSource) Token(context.Context) (string, error) {
	if s == "" {
		return "", errors.New("hub token is empty")
	}
	return string(s), nil
}

// String keeps the token out of formatted output.
func (StaticTokenSource) String() string { return "StaticTokenSource([redacted])" }

// GoString keeps the token out of formatted output.
func (StaticTokenSource) GoString() string { return "StaticTokenSource([redacted])" }
