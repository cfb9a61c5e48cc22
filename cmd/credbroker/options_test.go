package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/credbroker/credbroker/internal/testing/testpki"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// runCLI runs the command line without a broker and returns its exit code,
// standard output and standard error.
func runCLI(t *testing.T, stdin string, args ...string) (int, string, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := run(context.Background(), args, streams{in: strings.NewReader(stdin), out: &out, err: &errOut})
	return code, out.String(), errOut.String()
}

func writeCA(t *testing.T) string {
	t.Helper()
	ca, err := testpki.NewCA("cli.test")
	require.NoError(t, err)
	caFile, err := ca.WriteBundle(t.TempDir())
	require.NoError(t, err)
	return caFile
}

// The command line is checked before any connection: every case here would
// fail to connect (no broker listens on port 1), so exit code 2 and the
// message show that validation refused it first.
func TestFlagValidation(t *testing.T) {
	caFile := writeCA(t)
	notPEM := filepath.Join(t.TempDir(), "not.pem")
	require.NoError(t, os.WriteFile(notPEM, []byte("hello"), 0o600))
	conn := []string{"--broker", "127.0.0.1:1", "--ca-file", caFile, "--token-file", "-"}
	with := func(cmd string, args ...string) []string {
		return append(append([]string{"grants", cmd}, conn...), args...)
	}
	for _, tc := range []struct {
		name    string
		args    []string
		wantErr string
	}{
		{name: "revoke without selector", args: with("revoke"), wantErr: "say what to revoke: --credential-id, --user or --cluster"},
		{name: "revoke with only a reason", args: with("revoke", "--reason", "x"), wantErr: "say what to revoke"},
		{name: "credential id without JTI=", args: with("revoke", "--credential-id", "0b6c"), wantErr: "JTI=<jti>"},
		{name: "cluster without slash", args: with("list", "--cluster", "prod"), wantErr: "--cluster: \"prod\" is not of the form <namespace>/<name>"},
		{name: "cluster not DNS", args: with("list", "--cluster", "Fleet/prod"), wantErr: "--cluster"},
		{name: "bad output", args: with("list", "-o", "yaml"), wantErr: `-o/--output "yaml": want table or json`},
		{name: "unknown flag", args: with("list", "--namespace", "x"), wantErr: "unknown flag: --namespace"},
		{name: "positional argument", args: with("list", "extra"), wantErr: `unexpected arguments ["extra"]`},
		{name: "no broker", args: []string{"grants", "list", "--ca-file", caFile, "--token-file", "-"}, wantErr: "--broker-address is required"},
		{name: "broker without port", args: []string{"grants", "list", "--broker", "broker.example", "--ca-file", caFile, "--token-file", "-"},
			wantErr: "--broker-address: broker address \"broker.example\" is not host:port"},
		{name: "no CA file", args: []string{"grants", "list", "--broker", "b:1", "--token-file", "-"}, wantErr: "--ca-file is required"},
		{name: "CA file without PEM", args: []string{"grants", "list", "--broker", "b:1", "--ca-file", notPEM, "--token-file", "-"},
			wantErr: "holds no PEM certificate"},
		{name: "no token file", args: []string{"grants", "list", "--broker", "b:1", "--ca-file", caFile}, wantErr: "--token-file is required"},
		{name: "zero timeout", args: with("list", "--timeout", "0s"), wantErr: "--timeout 0s is not positive"},
		{name: "empty token on stdin", args: with("list"), wantErr: "--token-file: hub token file standard input is empty"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, out, errOut := runCLI(t, "", tc.args...)
			assert.Equal(t, exitUsage, code)
			assert.Empty(t, out)
			assert.Contains(t, errOut, tc.wantErr)
			assert.True(t, strings.HasPrefix(errOut, "credbroker: "), errOut)
		})
	}
}

func TestHelpExitsZero(t *testing.T) {
	code, out, _ := runCLI(t, "", "grants", "revoke", "--help")
	assert.Equal(t, exitOK, code)
	assert.Contains(t, out, "--credential-id")
	assert.Contains(t, out, "--reason")
}

func TestVersion(t *testing.T) {
	for _, args := range [][]string{{"version"}, {"--version"}, {"-v=2", "--version"}, {"--v=2", "version"}} {
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			code, out, errOut := runCLI(t, "", args...)
			assert.Equal(t, exitOK, code, errOut)
			assert.Regexp(t, `^credbroker \S+ \(revision \S+, go\S+\)\n$`, out)
		})
	}
	code, _, errOut := runCLI(t, "", "version", "extra")
	assert.Equal(t, exitUsage, code)
	assert.Contains(t, errOut, "unexpected arguments")
}

// -v/--v is the verbosity, as on the other binaries, not --version.
func TestVerbosity(t *testing.T) {
	code, out, errOut := runCLI(t, "", "grants", "list", "-v=2", "--help")
	assert.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "-v, --v int")
	code, out, errOut = runCLI(t, "", "-v")
	assert.Equal(t, exitUsage, code)
	assert.Empty(t, out)
	assert.Contains(t, errOut, "flag needs an argument")
	code, _, errOut = runCLI(t, "", "-v=-1", "version")
	assert.Equal(t, exitUsage, code)
	assert.Contains(t, errOut, "-v -1 is negative")
}

var now = time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)

func testGrant(id, cluster string, ttl time.Duration) *pb.Grant {
	ns, name, _ := strings.Cut(cluster, "/")
	return &pb.Grant{
		CredentialId:   id,
		Cluster:        &pb.ObjectReference{Namespace: ns, Name: name},
		ClusterUid:     "uid-" + name,
		Subject:        &pb.Subject{Username: "system:serviceaccount:argocd:controller", Uid: "u-1"},
		ServiceAccount: &pb.ObjectReference{Namespace: "argocd", Name: "deployer"},
		ExpirationTime: timestamppb.New(now.Add(ttl)),
	}
}

func TestPrintList(t *testing.T) {
	resp := &pb.ListGrantsResponse{Grants: []*pb.Grant{
		testGrant("JTI=1", "fleet/spoke-1", 45*time.Minute),
		testGrant("JTI=22", "fleet/spoke-22", 90*time.Second),
		{CredentialId: "JTI=evil\x1b[2J", Cluster: &pb.ObjectReference{Namespace: "fleet", Name: "x"}},
	}}
	var out, errOut bytes.Buffer
	require.NoError(t, printList(&out, &errOut, outputTable, resp, now))
	assert.Equal(t, `CLUSTER          CREDENTIAL-ID   SUBJECT                                   SERVICE-ACCOUNT   EXPIRES
fleet/spoke-1    JTI=1           system:serviceaccount:argocd:controller   argocd/deployer   45m
fleet/spoke-22   JTI=22          system:serviceaccount:argocd:controller   argocd/deployer   90s
fleet/x          JTI=evil?[2J    <none>                                    <none>            <unknown>
`, out.String())
	assert.Empty(t, errOut.String())

	out.Reset()
	require.NoError(t, printList(&out, &errOut, outputTable, &pb.ListGrantsResponse{}, now))
	assert.Empty(t, out.String())
	assert.Equal(t, "No grants found.\n", errOut.String())
}

func TestPrintListJSON(t *testing.T) {
	var out, errOut bytes.Buffer
	resp := &pb.ListGrantsResponse{Grants: []*pb.Grant{testGrant("JTI=1", "fleet/spoke-1", time.Hour)}}
	require.NoError(t, printList(&out, &errOut, outputJSON, resp, now))
	for _, want := range []string{`"credentialId": "JTI=1"`, `"clusterUid": "uid-spoke-1"`, `"expirationTime": "2026-11-30T13:00:00Z"`,
		`"username": "system:serviceaccount:argocd:controller"`} {
		assert.Contains(t, out.String(), want)
	}

	out.Reset()
	require.NoError(t, printList(&out, &errOut, outputJSON, &pb.ListGrantsResponse{}, now))
	assert.Equal(t, "{}\n", out.String(), "an empty list is still JSON")
}

func TestPrintRevoke(t *testing.T) {
	var out bytes.Buffer
	require.NoError(t, printRevoke(&out, outputTable, &pb.RevokeGrantsResponse{
		Revoked: []*pb.Grant{testGrant("JTI=1", "fleet/spoke-1", time.Hour)},
		Pending: []*pb.Grant{testGrant("JTI=2", "fleet/spoke-2", time.Hour)},
	}))
	assert.Equal(t, "revoked JTI=1 (cluster fleet/spoke-1, subject system:serviceaccount:argocd:controller, service account argocd/deployer)\n"+
		"pending JTI=2 (cluster fleet/spoke-2, subject system:serviceaccount:argocd:controller, service account argocd/deployer): "+
		"its agent is not connected to this broker replica or failed; the revoke is recorded on the hub, and every broker replica sends it again when the agent connects or reports the grant\n", out.String())
}
