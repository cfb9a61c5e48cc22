package cmdflags

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"

	"github.com/go-logr/logr"
	"github.com/spf13/pflag"
	"gopkg.in/natefinch/lumberjack.v2"
	"k8s.io/utils/clock"
)

// Stdout is the --audit-log-path that writes the audit lines to standard
// output.
const Stdout = "-"

// AuditFlags are the broker's flags of its audit log.
type AuditFlags struct {
	Path       string
	MaxSize    int // MiB
	MaxBackups int
	Mode       string // AuditBlocking or AuditBatch
}

// AddFlags adds --audit-log-path, --audit-log-max-size,
// --audit-log-max-backups and --audit-log-mode to fs.
func (a *AuditFlags) AddFlags(fs *pflag.FlagSet) {
	fs.StringVar(&a.Path, "audit-log-path", Stdout, `file that receives the audit lines (one JSON object per exchange, grants call, agent connect, disconnect and refusal; never a token), rotated by size; "-" is standard output, apart from the operational logs on standard error`)
	fs.IntVar(&a.MaxSize, "audit-log-max-size", 100, "size in MiB at which --audit-log-path is rotated")
	fs.IntVar(&a.MaxBackups, "audit-log-max-backups", 5, "rotated audit log files kept beside --audit-log-path; 0 keeps them all")
	fs.StringVar(&a.Mode, "audit-log-mode", AuditBlocking, `how audit lines are written: "blocking" writes each line before its call returns; "batch" writes the lines every 100ms (or at 256 KiB) and on exit, one write for many lines, and loses the lines of the last 100ms if the process crashes`)
}

// Open validates the flags and opens the audit log, batched for
// --audit-log-mode=batch. The writer is safe for concurrent Writes, and
// writes each whole (blocking) or never splits it (batch). The caller
// closes it on exit, which writes the lines a batch holds; closing
// standard output's does nothing else.
func (a *AuditFlags) Open() (io.WriteCloser, error) {
	switch {
	case a.Path == "":
		return nil, errors.New(`--audit-log-path must not be empty ("-" is standard output)`)
	case a.MaxSize <= 0:
		return nil, fmt.Errorf("--audit-log-max-size %d is not a positive number of MiB", a.MaxSize)
	case a.MaxBackups < 0:
		return nil, fmt.Errorf("--audit-log-max-backups %d is negative", a.MaxBackups)
	case a.Mode != "" && a.Mode != AuditBlocking && a.Mode != AuditBatch:
		return nil, fmt.Errorf("--audit-log-mode %q is neither %q nor %q", a.Mode, AuditBlocking, AuditBatch)
	}
	w, err := OpenAuditLog(a.Path, a.MaxSize, a.MaxBackups)
	if err != nil || a.Mode != AuditBatch {
		return w, err
	}
	return NewBatchWriter(w, clock.RealClock{}, BatchInterval), nil
}

// OpenAuditLog opens path for audit lines: standard output for "-", else a
// file rotated when it reaches maxSizeMiB, keeping maxBackups rotated files
// (0: all). The file is created (mode 0600) now, so that a path the process
// cannot write fails at start rather than at the first audit line.
func OpenAuditLog(path string, maxSizeMiB, maxBackups int) (io.WriteCloser, error) {
	if path == Stdout {
		return nopCloser{os.Stdout}, nil
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		return nil, fmt.Errorf("--audit-log-path: %w", err)
	}
	if err := f.Close(); err != nil {
		return nil, fmt.Errorf("--audit-log-path: %w", err)
	}
	return &lumberjack.Logger{Filename: path, MaxSize: maxSizeMiB, MaxBackups: maxBackups}, nil
}

// AuditLogger is the audit logger over w: JSON lines whatever --log-format
// is, every line written whatever -v is, and every value passed through
// token.Redact first.
func AuditLogger(w io.Writer) logr.Logger {
	h := redactHandler{slog.NewJSONHandler(w, &slog.HandlerOptions{Level: slog.LevelInfo})}
	return logr.FromSlogHandler(h).WithName("audit")
}

type nopCloser struct{ io.Writer }

func (nopCloser) Close() error { return nil }
