package main

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/credbroker/credbroker/test/framework"
)

// TestDemo tells the whole story of `make demo` on binaries built as
// `make build` builds them, so that a change that breaks a step, or
// empties what a step shows, fails here before a user finds it.
func TestDemo(t *testing.T) {
	if testing.Short() {
		t.Skip("starts three API servers, a broker and two agents")
	}
	dir := t.TempDir()
	require.NoError(t, framework.Build(t.Context(), dir, "credbroker-plugin", "credbroker", "broker", "spoke-agent"))
	deploy, err := framework.DeployDir()
	require.NoError(t, err)
	var out strings.Builder
	cfg, err := parseFlags([]string{
		"--plugin=" + dir + "/credbroker-plugin", "--cli=" + dir + "/credbroker",
		"--broker=" + dir + "/broker", "--agent=" + dir + "/spoke-agent", "--deploy=" + deploy,
	})
	require.NoError(t, err)
	cfg.out = &out

	err = run(t.Context(), cfg)
	t.Log(out.String())
	require.NoError(t, err)
	for _, want := range []string{
		"[12/12] what the hub keeps",
		"holding a spoke token: 0",
		"minted JTI=",
		"PermissionDenied",
		"grants revoke, revoked JTI=",
		"0 tokens in them",
	} {
		assert.True(t, strings.Contains(out.String(), want), "the story lacks %q", want)
	}
}
