package framework

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// Module is the import path of the repository's Go module.
const Module = "github.com/credbroker/credbroker"

// TestRevision is the revision Build links into the binaries, where
// `make build` links the git commit.
const TestRevision = "test-build"

// Version is the version `make build` links into the binaries: the
// repository's VERSION file.
func Version() (string, error) {
	root := moduleRoot()
	if root == "" {
		return "", errors.New("framework: the repository's source is not on disk")
	}
	raw, err := os.ReadFile(filepath.Join(root, "VERSION"))
	if err != nil {
		return "", fmt.Errorf("framework: read the version: %w", err)
	}
	return strings.TrimSpace(string(raw)), nil
}

// Build builds the named programs into dir the way `make build` does:
// static (CGO_ENABLED=0), -trimpath, and Version and TestRevision linked
// into internal/version.
// A name without a slash is a command of the repository (cmd/<name>);
// anything else is an import path. The binary of each is
// filepath.Join(dir, path.Base(name)).
func Build(ctx context.Context, dir string, names ...string) error {
	version, err := Version()
	if err != nil {
		return err
	}
	pkgs := make([]string, len(names))
	for i, name := range names {
		pkgs[i] = name
		if !strings.Contains(name, "/") {
			pkgs[i] = Module + "/cmd/" + name
		}
	}
	const pkg = Module + "/internal/version"
	args := append([]string{"build", "-trimpath",
		"-ldflags", "-X " + pkg + ".Version=" + version + " -X " + pkg + ".Revision=" + TestRevision,
		"-o", dir + string(os.PathSeparator)}, pkgs...)
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = moduleRoot()
	// Static, as the images hold them (hack/images), which also lets the
	// images' test reuse these builds' compiled packages.
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("framework: go build %s: %w\n%s", strings.Join(names, " "), err, out)
	}
	return nil
}
