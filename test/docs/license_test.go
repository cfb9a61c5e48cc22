package docs

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// apacheSHA256 is the SHA-256 of the Apache License 2.0 text as
// apache.org publishes it (LICENSE-2.0.txt), appendix included.
const apacheSHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"

// The project is Apache-2.0, stated once: LICENSE holds the license's own
// text, and no file carries a header of its own (docs/conventions.md).
func TestLicense(t *testing.T) {
	raw, err := os.ReadFile("../../LICENSE")
	require.NoError(t, err)
	sum := sha256.Sum256(raw)
	assert.Equal(t, apacheSHA256, hex.EncodeToString(sum[:]), "LICENSE is not the Apache License 2.0 text")

	out, err := exec.Command("git", "-C", "../..", "grep", "-lE", "Copyright [0-9]{4}|Licensed under the Apache",
		"--", "*.go", "*.proto", "*.sh", ":!test/docs/license_test.go").Output()
	if err != nil {
		var exit *exec.ExitError
		require.ErrorAs(t, err, &exit, "git grep")
		require.Equal(t, 1, exit.ExitCode(), "git grep: %s", exit.Stderr) // 1: nothing found
	}
	assert.Empty(t, strings.TrimSpace(string(out)), "files with a license header of their own")
}
