package docs

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const module = "github.com/credbroker/credbroker/"

// wireContract is how the import table names the generated proto package.
const wireContract = "the wire contract"

var (
	// A row of the import table: | `pkg/x` | holds | may import |.
	importRow  = regexp.MustCompile("^\\| `((?:pkg|internal)/[a-z/]+)` \\|.*\\| ([^|]+) \\|$")
	backticked = regexp.MustCompile("`([a-z/]+)`")
)

// The table in docs/architecture.md's "Packages and the import graph"
// names, for every package a binary links, each package of ours it
// imports, and no other.
func TestImportTable(t *testing.T) {
	out, err := exec.Command("go", "list", "-json=ImportPath,Imports", "../../pkg/...", "../../internal/...").Output()
	require.NoError(t, err)
	type pkg struct {
		ImportPath string
		Imports    []string
	}
	var pkgs []pkg
	ours := map[string]bool{wireContract: true}
	for dec := json.NewDecoder(bytes.NewReader(out)); dec.More(); {
		var p pkg
		require.NoError(t, dec.Decode(&p))
		if !strings.HasPrefix(p.ImportPath, module+"internal/testing") {
			pkgs = append(pkgs, p)
			ours[tableName(strings.TrimPrefix(p.ImportPath, module))] = true
		}
	}

	doc, err := os.ReadFile("../../docs/architecture.md")
	require.NoError(t, err)
	table := map[string][]string{}
	for line := range strings.Lines(string(doc)) {
		m := importRow.FindStringSubmatch(strings.TrimSpace(line))
		if m == nil {
			continue
		}
		names := []string{} // nil only for the assembly
		for _, b := range backticked.FindAllStringSubmatch(m[2], -1) {
			if ours[b[1]] { // not go-spiffe's `spiffeid`
				names = append(names, b[1])
			}
		}
		if strings.Contains(m[2], wireContract) {
			names = append(names, wireContract)
		}
		if strings.HasPrefix(m[2], "everything") {
			names = nil // the assembly, checked by nothing
		}
		table[m[1]] = names
	}

	for _, p := range pkgs {
		pkg := strings.TrimPrefix(p.ImportPath, module)
		named, ok := table[pkg]
		if !assert.True(t, ok, "docs/architecture.md's import table has no row for %s", pkg) || named == nil {
			continue
		}
		var imports []string
		for _, imp := range p.Imports {
			if imp, ok := strings.CutPrefix(imp, module); ok {
				imports = append(imports, tableName(imp))
			}
		}
		assert.ElementsMatch(t, named, imports, "the packages of ours that %s imports, by docs/architecture.md and by go list", pkg)
	}
}

// tableName is how the import table names a package of ours.
func tableName(imp string) string {
	switch {
	case strings.HasPrefix(imp, "proto/"):
		return wireContract
	case imp == "pkg/grants/selector":
		return "grants/selector"
	}
	return path.Base(imp)
}
