package docs

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/credbroker/credbroker/test/framework"
)

// binaries are the commands whose flags the docs describe.
var binaries = []string{"broker", "spoke-agent", "credbroker-plugin", "credbroker"}

// foreign are flags the docs mention that belong to other tools, each with
// the tool: a --flag in the docs that is neither ours nor listed here fails.
var foreign = map[string]string{
	"cert":                                 "kubectl create secret tls",
	"key":                                  "kubectl create secret tls",
	"from-file":                            "kubectl create secret generic",
	"dry-run":                              "kubectl create",
	"audience":                             "kubectl create token (also ours)",
	"duration":                             "kubectl create token",
	"clusterprofile-provider-file":         "cluster-inventory-api consumers (their flag, pointing at a provider file)",
	"server-side":                          "kubectl apply",
	"context":                              "kubectl",
	"namespace":                            "kubectl (also ours)",
	"update":                               "go test in test/monitoring",
	"timeout-coefficient":                  "gremlins unleash (make mutate)",
	"workers":                              "gremlins unleash (make mutate)",
	"subresource":                          "kubectl patch --subresource=status",
	"type":                                 "kubectl patch --type",
	"cascade":                              "kubectl delete --cascade=foreground",
	"from":                                 "a Dockerfile's COPY --from=<image> that puts the plugin into an Argo CD image",
	"service-account-max-token-expiration": "kube-apiserver (the spoke's cap on token lifetimes)",
	"service-account-extend-token-expiration": "kube-apiserver (a year for the kubelet's projected tokens)",
}

// aliases are flag names our binaries accept but do not list in --help.
var aliases = map[string]string{
	"broker": "credbroker: --broker-address (flag normalization)",
}

// exempt are flags that no doc needs to mention.
var exempt = []string{"help", "h"}

var (
	// A flag line of --help: stdlib flag prints "  -name type", pflag and
	// cobra "  -n, --name type" or "      --name type".
	helpFlag = regexp.MustCompile(`^\s+(?:-[a-zA-Z], )?--?([a-z0-9][a-z0-9-]*)`)
	// A command line of cobra's "Available Commands:".
	helpCommand = regexp.MustCompile(`^  ([a-z][a-z0-9-]*)\s`)
	// A --flag in the docs; "--svid-*" names a family and is skipped.
	docFlag = regexp.MustCompile(`(?:^|[^\w-])--([a-z][a-z0-9-]*)(\*?)`)
)

// flagsOf runs bin --help, and that of every subcommand it lists, and
// returns the flags they print.
func flagsOf(t *testing.T, bin string, args ...string) map[string]bool {
	t.Helper()
	out, _ := exec.Command(bin, append(args, "--help")...).CombinedOutput() // the usage is checked below, not the exit code
	require.Contains(t, string(out), "sage", "%s %v --help printed no usage:\n%s", bin, args, out)
	flags := map[string]bool{}
	inCommands := false
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "Available Commands:"):
			inCommands = true
		case inCommands && strings.TrimSpace(line) == "":
			inCommands = false
		case inCommands:
			if m := helpCommand.FindStringSubmatch(line); m != nil && m[1] != "help" && m[1] != "completion" {
				for f := range flagsOf(t, bin, append(args, m[1])...) {
					flags[f] = true
				}
			}
		default:
			if m := helpFlag.FindStringSubmatch(line); m != nil {
				flags[m[1]] = true
			}
		}
	}
	return flags
}

// buildBinaries builds the binaries into a temporary folder and returns it.
func buildBinaries(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	require.NoError(t, framework.Build(t.Context(), dir, binaries...))
	return dir
}

// docFiles are README.md, docs/*.md and every text file under deploy/.
func docFiles(t *testing.T) []string {
	t.Helper()
	files := []string{"../../README.md"}
	md, err := filepath.Glob("../../docs/*.md")
	require.NoError(t, err)
	files = append(files, md...)
	require.NoError(t, filepath.WalkDir("../../deploy", func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		switch filepath.Ext(path) {
		case ".md", ".yaml", ".yml", ".json", ".conf", ".txt":
			files = append(files, path)
		}
		return nil
	}))
	return files
}

// The docs and deploy/ mention no flag that our binaries lack (except the
// listed flags of other tools), and mention every flag they have.
func TestDocumentedFlagsExist(t *testing.T) {
	dir := buildBinaries(t)

	have := map[string][]string{} // flag: the binaries that have it
	for _, b := range binaries {
		for f := range flagsOf(t, filepath.Join(dir, b)) {
			have[f] = append(have[f], b)
		}
	}
	require.Contains(t, have, "broker-address", "no flag parsed from --help")

	mentioned := map[string]bool{}
	for _, file := range docFiles(t) {
		raw, err := os.ReadFile(file)
		require.NoError(t, err)
		for i, line := range strings.Split(string(raw), "\n") {
			for _, m := range docFlag.FindAllStringSubmatch(line, -1) {
				f := m[1]
				if m[2] != "" {
					continue
				}
				mentioned[f] = true
				_, ours := have[f]
				_, other := foreign[f]
				_, alias := aliases[f]
				assert.True(t, ours || other || alias, "%s:%d mentions --%s, which no binary has (%v); fix the doc, or list another tool's flag in foreign",
					strings.TrimPrefix(file, "../../"), i+1, f, binaries)
			}
		}
	}
	for f, bins := range have {
		if !slices.Contains(exempt, f) {
			assert.True(t, mentioned[f], "--%s of %v is in no doc: describe it in docs/operations.md", f, bins)
		}
	}
}
