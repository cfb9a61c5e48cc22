package docs

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var (
	// A test, fuzz target, benchmark or example as the docs name it.
	namedTest = regexp.MustCompile(`\b(?:Test|Fuzz|Benchmark|Example)[A-Z][A-Za-z0-9_]*`)
	// One as a _test.go file defines it, a method's receiver aside.
	definedTest = regexp.MustCompile(`(?m)^func (?:\([^)]*\) )?((?:Test|Fuzz|Benchmark|Example)[A-Za-z0-9_]*)\(`)
)

// placeholderTests are the names docs/testing.md uses for "any test".
var placeholderTests = map[string]bool{"TestName": true, "FuzzX": true, "FuzzName": true}

// Every test the README and docs/ name exists, so that a security case or a
// measured figure never points at a test that was renamed or removed.
func TestNamedTestsExist(t *testing.T) {
	defined := map[string]bool{}
	require.NoError(t, filepath.WalkDir("../..", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && strings.HasPrefix(d.Name(), ".") && path != "../.." {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range definedTest.FindAllSubmatch(src, -1) {
			defined[string(m[1])] = true
		}
		return nil
	}))
	require.Contains(t, defined, "TestNamedTestsExist", "the walk found no test files")

	files := []string{"../../README.md"}
	for _, glob := range []string{"../../docs/*.md", "../../docs/*/*.md"} {
		md, err := filepath.Glob(glob)
		require.NoError(t, err)
		files = append(files, md...)
	}
	for _, file := range files {
		text, err := os.ReadFile(file)
		require.NoError(t, err)
		for i, line := range strings.Split(string(text), "\n") {
			for _, name := range namedTest.FindAllString(line, -1) {
				assert.True(t, defined[name] || placeholderTests[name],
					"%s:%d names %s, which no _test.go file defines", file, i+1, name)
			}
		}
	}
}
