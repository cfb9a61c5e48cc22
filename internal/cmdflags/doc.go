// Package cmdflags holds what the mains of broker, spoke-agent and
// credbroker-plugin share: a pflag FlagSet parsed as kubectl parses its
// flags, --version, -v/--v and --log-format, the operational logger those
// choose, and the exit codes (0, 1 when the command failed, 2 for a bad
// command line).
//
// Operational logs go to standard error: klog's text format by default, or
// JSON lines of log/slog with --log-format=json. -v raises the verbosity
// in both. Every binary takes -v/--v, as kubectl does (AddVerbosity, also
// for the credbroker CLI's cobra flags), and --version without a shorthand;
// the plugin and the CLI write no log, so -v changes nothing there.
//
// The SPIFFE identity flags that the broker and the spoke agent share are
// in the subpackage identityflags. Serve builds a service with its New and runs it until SIGINT or
// SIGTERM, which is all their mains do once the flags are parsed.
//
// The broker's audit log (AuditFlags, AuditLogger) is JSON lines apart
// from the operational logs, every string a caller or an agent can
// influence passed through token.Redact, written line by line
// (--audit-log-mode=blocking) or in batches every BatchInterval
// (--audit-log-mode=batch, NewBatchWriter). The exchange writes its own
// lines, in the same JSON, to the writer that Open returns (which is safe
// for concurrent Writes); AuditLogger writes the grants and agent lines.
//
// The FlagSet also accepts a long flag written with a single dash
// (-broker-address=x), as Go's flag package did before the mains moved to
// pflag, so existing command lines and exec configs keep working.
package cmdflags
