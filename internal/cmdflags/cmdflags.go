package cmdflags

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"

	"github.com/go-logr/logr"
	"github.com/spf13/pflag"
	"k8s.io/klog/v2/textlogger"

	"github.com/credbroker/credbroker/internal/version"
)

// Log formats of --log-format.
const (
	FormatText = "text"
	FormatJSON = "json"
)

// Exit codes of the binaries.
const (
	ExitOK     = 0
	ExitFailed = 1
	ExitUsage  = 2
)

// ErrVersion is returned by Parse when --version was given.
var ErrVersion = errors.New("version requested")

// helpError is returned by Parse for -h and --help; it wraps pflag.ErrHelp
// and carries the usage text.
type helpError struct{ usage string }

func (e *helpError) Error() string { return pflag.ErrHelp.Error() }
func (e *helpError) Unwrap() error { return pflag.ErrHelp }

// Common are the flags every binary has.
type Common struct {
	name      string
	header    string
	fs        *pflag.FlagSet
	version   bool
	Verbosity int
	// LogFormat is --log-format; only binaries that call AddLogFlags have it.
	LogFormat string
}

// New returns a FlagSet for the binary name, and Common bound to it; Parse
// adds --version, last. header opens the --help text, above the flags.
func New(name, header string) (*pflag.FlagSet, *Common) {
	fs := pflag.NewFlagSet(name, pflag.ContinueOnError)
	fs.SetOutput(io.Discard) // Parse returns the errors and the usage
	fs.SortFlags = false
	return fs, &Common{name: name, header: header, fs: fs, LogFormat: FormatText}
}

// Usages of -v/--v: VerbosityUsage on the binaries that log, QuietVerbosityUsage
// on those that take it only to be like the others.
const (
	VerbosityUsage      = "log verbosity: 0 logs what an operator acts on, higher values more detail"
	QuietVerbosityUsage = "log verbosity, taken as by the other credbroker binaries and kubectl; this one writes no log, so it changes nothing"
)

// AddVerbosity adds -v/--v to fs, bound to v. Every binary takes it, as
// kubectl does, whether it logs or not; --version has no shorthand.
// CheckVerbosity checks the value after parsing.
func AddVerbosity(fs *pflag.FlagSet, v *int, usage string) {
	fs.IntVarP(v, "v", "v", 0, usage)
}

// CheckVerbosity refuses a negative -v.
func CheckVerbosity(v int) error {
	if v < 0 {
		return fmt.Errorf("-v %d is negative", v)
	}
	return nil
}

// AddVerbosityFlag adds -v/--v with usage, for a binary without
// --log-format.
func (c *Common) AddVerbosityFlag(usage string) {
	AddVerbosity(c.fs, &c.Verbosity, usage)
}

// AddLogFlags adds -v/--v and --log-format, for the long-running binaries.
func (c *Common) AddLogFlags() {
	c.AddVerbosityFlag(VerbosityUsage)
	c.fs.StringVar(&c.LogFormat, "log-format", FormatText, `format of the operational logs on standard error: "text" (klog) or "json" (JSON lines)`)
}

// Parse parses args. It returns ErrVersion for --version, an error wrapping
// pflag.ErrHelp for -h and --help, and refuses positional arguments.
func (c *Common) Parse(args []string) error {
	c.addVersion()
	if err := c.fs.Parse(singleDashLong(c.fs, args)); err != nil {
		if errors.Is(err, pflag.ErrHelp) {
			return &helpError{usage: c.Usage()}
		}
		return fmt.Errorf("%w (see --help)", err)
	}
	if c.version {
		return ErrVersion
	}
	if c.fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q (see --help)", c.fs.Args())
	}
	if c.LogFormat != FormatText && c.LogFormat != FormatJSON {
		return fmt.Errorf("--log-format %q: want %q or %q", c.LogFormat, FormatText, FormatJSON)
	}
	return CheckVerbosity(c.Verbosity)
}

func (c *Common) addVersion() {
	if c.fs.Lookup("version") == nil {
		c.fs.BoolVar(&c.version, "version", false, "print the version and exit")
	}
}

// Usage is the --help text.
func (c *Common) Usage() string {
	c.addVersion()
	return c.header + "\n\nFlags:\n" + c.fs.FlagUsages()
}

// singleDashLong rewrites "-name" and "-name=value" to "--name..." when name
// is a long flag of fs with more than one letter, as Go's flag package
// accepted them. Everything after "--" is left alone.
func singleDashLong(fs *pflag.FlagSet, args []string) []string {
	out := make([]string, 0, len(args))
	for i, a := range args {
		if a == "--" {
			return append(out, args[i:]...)
		}
		if len(a) > 2 && a[0] == '-' && a[1] != '-' {
			name, _, _ := strings.Cut(a[1:], "=")
			if len(name) > 1 && fs.Lookup(name) != nil {
				a = "-" + a
			}
		}
		out = append(out, a)
	}
	return out
}

// Logger returns the operational logger that --log-format and -v choose,
// writing to w (standard error in the binaries).
func (c *Common) Logger(w io.Writer) logr.Logger {
	if c.LogFormat == FormatJSON {
		return JSONLogger(w, c.Verbosity)
	}
	return textlogger.NewLogger(textlogger.NewConfig(textlogger.Verbosity(c.Verbosity), textlogger.Output(w)))
}

// JSONLogger is a logr.Logger that writes JSON lines to w through log/slog;
// V(n) lines are written when n <= verbosity.
func JSONLogger(w io.Writer, verbosity int) logr.Logger {
	// logr's V(n) is slog level -n.
	h := slog.NewJSONHandler(w, &slog.HandlerOptions{Level: slog.Level(-verbosity)})
	return logr.FromSlogHandler(h)
}

// IsHelpOrVersion reports whether err asks for the help or the version.
func IsHelpOrVersion(err error) bool {
	return errors.Is(err, ErrVersion) || errors.Is(err, pflag.ErrHelp)
}

// ExitOnParse ends the process when Parse (or the parsing of the binary
// called name) did not leave it a command to run: it prints the version or
// the help to standard output and exits 0, or prints err to standard error
// and exits 2. It returns when err is nil.
func ExitOnParse(name string, err error) {
	if err == nil {
		return
	}
	code := exitOnParse(name, err, os.Stdout, os.Stderr)
	os.Exit(code)
}

func exitOnParse(name string, err error, stdout, stderr io.Writer) int {
	var help *helpError
	switch {
	case errors.Is(err, ErrVersion):
		fmt.Fprintln(stdout, version.Line(name))
		return ExitOK
	case errors.As(err, &help):
		fmt.Fprint(stdout, help.usage)
		return ExitOK
	default:
		fmt.Fprintf(stderr, "%s: %v\n", name, err)
		return ExitUsage
	}
}

// Run runs fn under a context that SIGINT and SIGTERM cancel, then closes
// closers (such as the audit log) and exits: 0, or 1 when fn failed, after
// logging its error with msg.
func Run(log logr.Logger, msg string, fn func(context.Context) error, closers ...io.Closer) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := fn(ctx)
	stop()
	if err != nil {
		log.Error(err, msg)
	}
	for _, c := range closers {
		if cerr := c.Close(); cerr != nil {
			log.Error(cerr, "closing on exit failed")
			err = errors.Join(err, cerr)
		}
	}
	if err != nil {
		os.Exit(ExitFailed)
	}
	os.Exit(ExitOK)
}

// Serve builds a service with newService(cfg) and runs it until SIGINT or
// SIGTERM, under Run: log, msg and closers are Run's.
func Serve[C any, S interface{ Run(context.Context) error }](log logr.Logger, msg string, newService func(C) (S, error), cfg C, closers ...io.Closer) {
	Run(log, msg, func(ctx context.Context) error {
		s, err := newService(cfg)
		if err != nil {
			return err
		}
		return s.Run(ctx)
	}, closers...)
}

// Float32 returns a flag value of a finite float32 stored in p; the whole
// value must be the number.
func Float32(p *float32) pflag.Value { return &float32Value{p} }

type float32Value struct{ p *float32 }

func (v *float32Value) Set(s string) error {
	f, err := strconv.ParseFloat(s, 32)
	if err != nil || math.IsInf(f, 0) || math.IsNaN(f) {
		return fmt.Errorf("not a finite number: %q", s)
	}
	*v.p = float32(f)
	return nil
}
func (v *float32Value) String() string { return strconv.FormatFloat(float64(*v.p), 'g', -1, 32) }
func (v *float32Value) Type() string   { return "float32" }
