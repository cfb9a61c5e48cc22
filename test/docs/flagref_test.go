package docs

import (
	"bufio"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

var update = flag.Bool("update", false, "rewrite the Flags section of docs/operations.md from the binaries' --help")

// referenced are the commands whose flags docs/operations.md lists, each
// as its binary and arguments.
var referenced = [][]string{
	{"broker"}, {"spoke-agent"}, {"credbroker-plugin"},
	{"credbroker", "kubeconfig"}, {"credbroker", "grants", "list"}, {"credbroker", "grants", "revoke"},
}

// pflagLine is a flag line of pflag's and cobra's --help:
// "  -v, --v Level   usage (default 0)" or "      --name type   usage".
var pflagLine = regexp.MustCompile(`^\s+(?:-[a-zA-Z], )?--([a-z0-9][a-z0-9-]*)(?: \S+)?\s{2,}(.*)$`)

var defaultSuffix = regexp.MustCompile(` \(default (.*)\)$`)

// flagReference renders the Flags section's body: per command, every flag
// but --help, sorted, with its default and usage.
func flagReference(t *testing.T, dir string) string {
	t.Helper()
	var b strings.Builder
	for _, cmd := range referenced {
		out, err := exec.Command(filepath.Join(dir, cmd[0]), append(cmd[1:], "--help")...).Output()
		require.NoError(t, err, "%v --help", cmd)
		var lines []string
		sc := bufio.NewScanner(strings.NewReader(string(out)))
		for sc.Scan() {
			m := pflagLine.FindStringSubmatch(sc.Text())
			if m == nil || m[1] == "help" {
				continue
			}
			usage, def := m[2], ""
			if d := defaultSuffix.FindStringSubmatch(usage); d != nil {
				usage, def = strings.TrimSuffix(usage, d[0]), " ("+d[1]+")"
			}
			lines = append(lines, fmt.Sprintf("- `--%s`%s: %s", m[1], def, usage))
		}
		require.NotEmpty(t, lines, "no flag parsed from %v --help", cmd)
		slices.Sort(lines)
		fmt.Fprintf(&b, "### `%s`\n\n%s\n\n", strings.Join(cmd, " "), strings.Join(lines, "\n"))
	}
	return b.String()
}

// The Flags section of docs/operations.md is what the binaries' --help
// says; `go test ./test/docs -run TestFlagReference -args -update`
// rewrites it.
func TestFlagReference(t *testing.T) {
	const path = "../../docs/operations.md"
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	doc := string(raw)
	const heading = "## Flags\n"
	start := strings.Index(doc, heading)
	require.GreaterOrEqual(t, start, 0, "docs/operations.md has no %q", heading)
	// The section's body starts at its first ### and ends at the next ##.
	body := start + strings.Index(doc[start:], "\n### ") + 1
	end := len(doc)
	if next := strings.Index(doc[body:], "\n## "); next >= 0 {
		end = body + next + 1
	}
	want := flagReference(t, buildBinaries(t))
	if *update {
		require.NoError(t, os.WriteFile(path, []byte(doc[:body]+want+doc[end:]), 0o644))
		return
	}
	require.Equal(t, want, doc[body:end], "the Flags section of docs/operations.md differs from --help: run go test ./test/docs -run TestFlagReference -args -update")
}
