package cmdflags

import (
	"bytes"
	"encoding/json"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spf13/pflag"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParse(t *testing.T) {
	tests := []struct {
		name          string
		args          []string
		wantErr       string
		wantHelp      bool
		wantVersion   bool
		wantVerbosity int
		wantFormat    string
		wantAddr      string
	}{
		{name: "defaults", wantFormat: FormatText},
		{name: "shorthand v", args: []string{"-v", "3"}, wantVerbosity: 3, wantFormat: FormatText},
		{name: "shorthand v with =", args: []string{"-v=2"}, wantVerbosity: 2, wantFormat: FormatText},
		{name: "long v", args: []string{"--v=4"}, wantVerbosity: 4, wantFormat: FormatText},
		{name: "json", args: []string{"--log-format=json"}, wantFormat: FormatJSON},
		{name: "single dash long flag", args: []string{"-address=a:1", "-log-format", "json"}, wantAddr: "a:1", wantFormat: FormatJSON},
		{name: "after --", args: []string{"--", "-address=a:1"}, wantErr: `unexpected arguments ["-address=a:1"] (see --help)`},
		{name: "bad format", args: []string{"--log-format=xml"}, wantErr: `--log-format "xml": want "text" or "json"`},
		{name: "negative verbosity", args: []string{"-v=-1"}, wantErr: "-v -1 is negative"},
		{name: "unknown flag", args: []string{"--nope"}, wantErr: "unknown flag: --nope (see --help)"},
		{name: "help", args: []string{"--help"}, wantHelp: true},
		{name: "short help", args: []string{"-h"}, wantHelp: true},
		{name: "version", args: []string{"--version"}, wantVersion: true},
		{name: "verbosity and version", args: []string{"-v=2", "--version"}, wantVersion: true},
		{name: "positional", args: []string{"x"}, wantErr: `unexpected arguments ["x"]`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fs, c := New("test", "Usage: test")
			var addr string
			fs.StringVar(&addr, "address", "", "an address")
			c.AddLogFlags()
			err := c.Parse(tt.args)
			switch {
			case tt.wantHelp:
				require.ErrorIs(t, err, pflag.ErrHelp)
				var out, errOut bytes.Buffer
				assert.Equal(t, ExitOK, exitOnParse("test", err, &out, &errOut))
				assert.Contains(t, out.String(), "Usage: test\n\nFlags:\n")
				assert.Contains(t, out.String(), "-v, --v int")
				assert.Contains(t, out.String(), "--log-format string")
				assert.Contains(t, out.String(), "--version")
				assert.Empty(t, errOut.String())
				return
			case tt.wantVersion:
				require.ErrorIs(t, err, ErrVersion)
				var out, errOut bytes.Buffer
				assert.Equal(t, ExitOK, exitOnParse("test", err, &out, &errOut))
				assert.Regexp(t, `^test \S+ \(revision \S+, go\S+\)\n$`, out.String())
				return
			case tt.wantErr != "":
				require.ErrorContains(t, err, tt.wantErr)
				var out, errOut bytes.Buffer
				assert.Equal(t, ExitUsage, exitOnParse("test", err, &out, &errOut))
				assert.Equal(t, "test: "+err.Error()+"\n", errOut.String())
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.wantVerbosity, c.Verbosity)
			assert.Equal(t, tt.wantFormat, c.LogFormat)
			assert.Equal(t, tt.wantAddr, addr)
		})
	}
}

// Verbosity must work in both formats: V(n) lines appear when n <= -v.
func TestLoggerVerbosity(t *testing.T) {
	for _, format := range []string{FormatText, FormatJSON} {
		for _, v := range []int{0, 1, 2} {
			t.Run(format+"/v="+string(rune('0'+v)), func(t *testing.T) {
				_, c := New("test", "")
				c.LogFormat, c.Verbosity = format, v
				var buf bytes.Buffer
				log := c.Logger(&buf)
				log.Info("zero", "key", "value")
				log.V(1).Info("one")
				log.V(2).Info("two")
				out := buf.String()
				assert.Contains(t, out, "zero")
				assert.Equal(t, v >= 1, strings.Contains(out, "one"), out)
				assert.Equal(t, v >= 2, strings.Contains(out, "two"), out)
				lines := strings.Split(strings.TrimSpace(out), "\n")
				assert.Len(t, lines, v+1)
				for _, l := range lines {
					var m map[string]any
					isJSON := json.Unmarshal([]byte(l), &m) == nil
					assert.Equal(t, format == FormatJSON, isJSON, "line %q", l)
					if isJSON {
						assert.NotEmpty(t, m["msg"])
					}
				}
			})
		}
	}
}

func TestAuditLogStdout(t *testing.T) {
	a := AuditFlags{Path: Stdout, MaxSize: 100, MaxBackups: 5}
	w, err := a.Open()
	require.NoError(t, err)
	nc, ok := w.(nopCloser)
	require.True(t, ok, "%T", w)
	assert.Same(t, os.Stdout, nc.Writer)
	require.NoError(t, w.Close())
	// Standard output is still open.
	_, err = os.Stdout.Write(nil)
	require.NoError(t, err)
}

func TestAuditLogFlags(t *testing.T) {
	dir := t.TempDir()
	tests := []struct {
		name    string
		flags   AuditFlags
		wantErr string
	}{
		{name: "empty path", flags: AuditFlags{MaxSize: 1}, wantErr: `--audit-log-path must not be empty ("-" is standard output)`},
		{name: "zero size", flags: AuditFlags{Path: "-"}, wantErr: "--audit-log-max-size 0 is not a positive number of MiB"},
		{name: "negative backups", flags: AuditFlags{Path: "-", MaxSize: 1, MaxBackups: -1}, wantErr: "--audit-log-max-backups -1 is negative"},
		{name: "unwritable", flags: AuditFlags{Path: filepath.Join(dir, "missing", "audit.log"), MaxSize: 1}, wantErr: "--audit-log-path: open"},
		{name: "file", flags: AuditFlags{Path: filepath.Join(dir, "audit.log"), MaxSize: 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w, err := tt.flags.Open()
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			fi, err := os.Stat(tt.flags.Path)
			require.NoError(t, err, "the file is created at start")
			assert.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
			require.NoError(t, w.Close())
		})
	}
}

// A file past its max size is rotated: a backup appears beside it, and
// every line written is in one of them, whole.
func TestAuditLogRotation(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "audit.log")
	w, err := OpenAuditLog(path, 1, 5)
	require.NoError(t, err)
	log := AuditLogger(w)
	pad := strings.Repeat("padding ", 125) // 1000 bytes that Redact leaves
	const lines = 1500                     // about 1.5 MiB
	for i := range lines {
		log.Info("exchange", "n", i, "pad", pad)
	}
	require.NoError(t, w.Close())

	backups, err := filepath.Glob(filepath.Join(dir, "audit-*.log"))
	require.NoError(t, err)
	require.NotEmpty(t, backups, "a backup appears once the file passed 1 MiB")
	seen := 0
	for _, name := range append(backups, path) {
		data, err := os.ReadFile(name)
		require.NoError(t, err)
		fi, err := os.Stat(name)
		require.NoError(t, err)
		assert.LessOrEqual(t, fi.Size(), int64(1<<20), name)
		for l := range strings.SplitSeq(strings.TrimSpace(string(data)), "\n") {
			var m map[string]any
			require.NoError(t, json.Unmarshal([]byte(l), &m), "every line is whole JSON: %q", l)
			assert.Equal(t, "exchange", m["msg"])
			assert.Equal(t, "audit", m["logger"])
			seen++
		}
	}
	assert.Equal(t, lines, seen)
}

// The audit logger writes no token, nor any segment of one, whatever field
// carries it: a string, a list, an error, a value of another type, or one
// given to WithValues.
func TestAuditLoggerRedacts(t *testing.T) {
	const (
		header  = "eyJhbGciOiJFUzI1NiIsImtpZCI6IlNYUkFoR1VvUHpCWjJhZVhTcFRZOGxtczdjNUVtenlwVXk2RHBmMFZsNUkifQ"
		payload = "eyJhdWQiOlsiY3JlZGJyb2tlciJdLCJleHAiOjE3NjQ1MDQwMDAsInN1YiI6InN5c3RlbTpzZXJ2aWNlYWNjb3VudDphOmIifQ"
		sig     = "o8WAo1EjuUPCx2Jw3-XrL6v1bX8GmU0d5D4rCkZqk2u6b7m8l9q0w1e2r3t4y5u6i7o8p9a0s1d2f3g4h5j6k7l8z9"
	)
	jwt := header + "." + payload + "." + sig
	var buf bytes.Buffer
	log := AuditLogger(&buf).WithValues("withValues", jwt)
	log.Info("exchange", "reason", `audience "`+sig+`" is not allowed`, "audiences", []string{header, "ok"},
		"map", map[string]string{"k": payload}, "code", "PermissionDenied", "cacheHit", false)
	log.Error(errors.New("bad token "+jwt), "exchange failed")
	out := buf.String()
	for _, s := range []string{jwt, header, payload, sig} {
		assert.NotContains(t, out, s)
	}
	assert.Contains(t, out, `"audiences":["[redacted sha256:`)
	assert.Contains(t, out, `"ok"]`)
	assert.Contains(t, out, `"code":"PermissionDenied"`)
	assert.Contains(t, out, `"cacheHit":false`)
}

// The keys whose strings skip the token scan are those the services format
// themselves, and no other: every key of a line that may carry a caller's
// or an agent's string is scanned (the exchange's, the grants call's and
// an agent stream's). A token under any of them is redacted.
func TestAuditLoggerSkipsOnlyServiceFormattedKeys(t *testing.T) {
	assert.Equal(t, map[string]bool{"code": true, "latency": true, "expiration": true, "method": true}, serviceFormatted)
	const seg = "eyJhbGciOiJSUzI1NiIsImtpZCI6ImF0dGFja2VyLWNvbnRyb2xsZWQta2V5LWlkIn0"
	for _, key := range []string{
		// tokenexchange
		"cluster", "requestedServiceAccount", "audiences", "user", "uid", "serviceAccount", "tokenAudiences", "credentialID", "reason",
		// grants
		"selectorCredentialID", "selectorUsername", "selectorCluster", "revokeReason", "revoked", "pending",
		// tunnel
		"spiffeID", "instance",
	} {
		var buf bytes.Buffer
		AuditLogger(&buf).Info("line", key, seg)
		assert.NotContains(t, buf.String(), seg[:24], key)
		assert.Contains(t, buf.String(), `"`+key+`":"[redacted sha256:`, key)
	}
	// Inside a group, every string is scanned, whatever its key.
	var buf bytes.Buffer
	AuditLogger(&buf).Info("line", "g", slog.GroupValue(slog.String("code", seg)))
	assert.NotContains(t, buf.String(), seg[:24])
}
