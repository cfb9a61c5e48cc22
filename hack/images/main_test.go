package main

import (
	"archive/tar"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestImages builds the image of each binary as `make images` does, opens
// the tarball with go-containerregistry, checks its config, and runs the
// binary it holds with --version.
func TestImages(t *testing.T) {
	root, err := filepath.Abs("../..")
	require.NoError(t, err)
	v, err := os.ReadFile(filepath.Join(root, "VERSION"))
	require.NoError(t, err)
	version := strings.TrimSpace(string(v))
	require.NotEmpty(t, version)
	revision := "0123456789abcdef0123456789abcdef01234567-test"
	created := time.Unix(1767225600, 0).UTC()
	o := Options{Root: root, Out: t.TempDir(), Version: version, Revision: revision, Created: created, Arch: runtime.GOARCH}

	for _, bin := range []string{"broker", "spoke-agent", "credbroker-plugin"} {
		t.Run(bin, func(t *testing.T) {
			path, size, err := Build(o, bin)
			require.NoError(t, err)
			t.Logf("%s: %s, %d bytes (%.1f MiB)", Tag(bin, version), path, size, float64(size)/(1<<20))

			tag, err := name.NewTag(Tag(bin, version))
			require.NoError(t, err)
			img, err := tarball.ImageFromPath(path, &tag)
			require.NoError(t, err, "the tarball holds the tag %s", tag)

			cf, err := img.ConfigFile()
			require.NoError(t, err)
			assert.Equal(t, "65532:65532", cf.Config.User, "the binary runs as the non-root user")
			assert.Equal(t, []string{"/" + bin}, cf.Config.Entrypoint)
			assert.Empty(t, cf.Config.Cmd)
			assert.Equal(t, "linux", cf.OS)
			assert.Equal(t, runtime.GOARCH, cf.Architecture)
			assert.Equal(t, created, cf.Created.UTC())
			assert.Equal(t, map[string]string{
				"org.opencontainers.image.title":    bin,
				"org.opencontainers.image.version":  version,
				"org.opencontainers.image.revision": revision,
				"org.opencontainers.image.source":   "https://github.com/credbroker/credbroker",
				"org.opencontainers.image.created":  created.Format(time.RFC3339),
			}, cf.Config.Labels)

			layers, err := img.Layers()
			require.NoError(t, err)
			require.Len(t, layers, 1, "an empty base and one layer")

			// The layer holds the binary and nothing else.
			rc, err := layers[0].Uncompressed()
			require.NoError(t, err)
			defer rc.Close()
			exe := filepath.Join(t.TempDir(), bin)
			tr := tar.NewReader(rc)
			var names []string
			for {
				h, err := tr.Next()
				if errors.Is(err, io.EOF) {
					break
				}
				require.NoError(t, err)
				names = append(names, h.Name)
				assert.Equal(t, int64(0o755), h.Mode, h.Name)
				assert.Equal(t, created, h.ModTime.UTC(), h.Name)
				f, err := os.OpenFile(exe, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o755)
				require.NoError(t, err)
				_, err = io.Copy(f, tr)
				require.NoError(t, err)
				require.NoError(t, f.Close())
			}
			require.Equal(t, []string{bin}, names)

			out, err := exec.Command(exe, "--version").CombinedOutput()
			require.NoError(t, err, "%s", out)
			assert.Regexp(t, `^`+bin+` `+version+` \(revision `+revision+`, go\S+\)\n$`, string(out))
		})
	}
}

// Two builds of one commit write the same image.
func TestImageReproducible(t *testing.T) {
	o := Options{Version: "v9.9.9", Revision: "abc", Created: time.Unix(0, 0).UTC(), Arch: "amd64"}
	exe := []byte("#!/bin/false\n")
	a, err := Image(o, "broker", exe)
	require.NoError(t, err)
	b, err := Image(o, "broker", exe)
	require.NoError(t, err)
	da, err := a.Digest()
	require.NoError(t, err)
	db, err := b.Digest()
	require.NoError(t, err)
	assert.Equal(t, da, db)
}
