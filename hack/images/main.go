package main

import (
	"archive/tar"
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// Constants of every image.
const (
	Registry = "ghcr.io/credbroker"
	Source   = "https://github.com/credbroker/credbroker"
	// User is the non-root user and group the binaries run as: distroless's
	// "nonroot".
	User = "65532:65532"
	// versionPkg receives the version ldflags.
	versionPkg = "github.com/credbroker/credbroker/internal/version"
)

// Options say what to build.
type Options struct {
	// Root is the repository; Out receives <binary>.tar.
	Root, Out string
	// Version and Revision are linked into the binary and labelled.
	Version, Revision string
	// Created is every time in the image.
	Created time.Time
	// Arch is the GOARCH of the binary and the image; the OS is linux.
	Arch string
}

func main() {
	var o Options
	flag.StringVar(&o.Root, "root", ".", "the credbroker repository")
	flag.StringVar(&o.Out, "out", "bin/images", "directory that receives <binary>.tar")
	flag.StringVar(&o.Version, "version", "", "release version, such as the VERSION file's (required)")
	flag.StringVar(&o.Revision, "revision", "", `commit of the build, "-dirty" when the tree has changes (required)`)
	flag.StringVar(&o.Arch, "arch", runtime.GOARCH, "GOARCH of the binaries and images")
	flag.Parse()
	if err := run(o, flag.Args()); err != nil {
		fmt.Fprintln(os.Stderr, "images:", err)
		os.Exit(1)
	}
}

func run(o Options, binaries []string) error {
	if o.Version == "" || o.Revision == "" || len(binaries) == 0 {
		return errors.New("usage: images --version V --revision R [--root DIR] [--out DIR] BINARY...")
	}
	created, err := commitTime(o.Root, strings.TrimSuffix(o.Revision, "-dirty"))
	if err != nil {
		return err
	}
	o.Created = created
	if err := os.MkdirAll(o.Out, 0o755); err != nil {
		return err
	}
	for _, bin := range binaries {
		path, size, err := Build(o, bin)
		if err != nil {
			return err
		}
		fmt.Printf("%s: %s (%s, %.1f MiB)\n", bin, path, Tag(bin, o.Version), float64(size)/(1<<20))
	}
	return nil
}

// commitTime is the committer time of rev, or the Unix epoch when git cannot
// tell (a tree outside git): either way, the same for every build.
func commitTime(root, rev string) (time.Time, error) {
	out, err := exec.Command("git", "-C", root, "show", "-s", "--format=%ct", rev).Output()
	if err != nil {
		return time.Unix(0, 0).UTC(), nil
	}
	secs, err := strconv.ParseInt(strings.TrimSpace(string(out)), 10, 64)
	if err != nil {
		return time.Time{}, fmt.Errorf("commit time of %s: %w", rev, err)
	}
	return time.Unix(secs, 0).UTC(), nil
}

// Tag is the image name of bin.
func Tag(bin, version string) string { return Registry + "/" + bin + ":" + version }

// Build builds ./cmd/<bin> and writes its image to <Out>/<bin>.tar; it
// returns the tarball's path and size.
func Build(o Options, bin string) (string, int64, error) {
	exe, err := compile(o, bin)
	if err != nil {
		return "", 0, err
	}
	img, err := Image(o, bin, exe)
	if err != nil {
		return "", 0, fmt.Errorf("%s: %w", bin, err)
	}
	tag, err := name.NewTag(Tag(bin, o.Version), name.StrictValidation)
	if err != nil {
		return "", 0, err
	}
	path := filepath.Join(o.Out, bin+".tar")
	if err := tarball.WriteToFile(path, tag, img); err != nil {
		return "", 0, fmt.Errorf("%s: write %s: %w", bin, path, err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		return "", 0, err
	}
	return path, fi.Size(), nil
}

// compile builds a static linux binary and returns its bytes.
func compile(o Options, bin string) ([]byte, error) {
	dir, err := os.MkdirTemp("", "credbroker-image-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	out := filepath.Join(dir, bin)
	ldflags := fmt.Sprintf("-s -w -X %s.Version=%s -X %s.Revision=%s", versionPkg, o.Version, versionPkg, o.Revision)
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags", ldflags, "-o", out, "./cmd/"+bin)
	cmd.Dir = o.Root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+o.Arch, "GOFLAGS=-mod=readonly")
	if msg, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("go build ./cmd/%s: %w\n%s", bin, err, msg)
	}
	return os.ReadFile(out)
}

// Image is the image of bin: an empty base, one layer holding exe at
// /<bin>, and the config.
func Image(o Options, bin string, exe []byte) (v1.Image, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	if err := tw.WriteHeader(&tar.Header{
		Typeflag: tar.TypeReg, Name: bin, Mode: 0o755, Size: int64(len(exe)),
		ModTime: o.Created, Format: tar.FormatPAX,
	}); err != nil {
		return nil, err
	}
	if _, err := tw.Write(exe); err != nil {
		return nil, err
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	layerTar := buf.Bytes()
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	})
	if err != nil {
		return nil, err
	}
	img, err := mutate.Append(empty.Image, mutate.Addendum{
		Layer: layer,
		History: v1.History{
			Created:   v1.Time{Time: o.Created},
			CreatedBy: "hack/images: go build ./cmd/" + bin,
			Comment:   "static binary, CGO_ENABLED=0",
		},
	})
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", o.Arch
	cf.Created = v1.Time{Time: o.Created}
	cf.Config.Entrypoint = []string{"/" + bin}
	cf.Config.User = User
	cf.Config.Labels = Labels(o, bin)
	return mutate.ConfigFile(img, cf)
}

// Labels are the org.opencontainers.image.* labels of bin's image.
func Labels(o Options, bin string) map[string]string {
	return map[string]string{
		"org.opencontainers.image.title":    bin,
		"org.opencontainers.image.version":  o.Version,
		"org.opencontainers.image.revision": o.Revision,
		"org.opencontainers.image.source":   Source,
		"org.opencontainers.image.created":  o.Created.Format(time.RFC3339),
	}
}
