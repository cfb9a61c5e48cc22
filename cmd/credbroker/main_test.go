package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/credbroker/credbroker/internal/testing/testpki"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

const hubToken = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJodWIifQ.c2lnbmF0dXJl"

// fakeGrants is a Grants server that checks the bearer token, records
// requests, lists two grants, refuses to revoke JTI=denied and leaves
// JTI=2 pending.
type fakeGrants struct {
	pb.UnimplementedGrantsServer

	mu       sync.Mutex
	requests []proto.Message
}

func (f *fakeGrants) check(ctx context.Context, req proto.Message) error {
	md, _ := metadata.FromIncomingContext(ctx)
	if got := md.Get("authorization"); len(got) != 1 || got[0] != "Bearer "+hubToken {
		return status.Error(codes.Unauthenticated, "fake broker: wrong or missing authorization metadata")
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.requests = append(f.requests, proto.Clone(req))
	return nil
}

func (f *fakeGrants) List(ctx context.Context, req *pb.ListGrantsRequest) (*pb.ListGrantsResponse, error) {
	if err := f.check(ctx, req); err != nil {
		return nil, err
	}
	resp := &pb.ListGrantsResponse{Grants: []*pb.Grant{
		testGrant("JTI=1", "fleet/spoke-1", time.Hour), testGrant("JTI=2", "fleet/spoke-2", time.Hour),
	}}
	for _, g := range resp.Grants {
		g.ExpirationTime = timestamppb.New(time.Now().Add(time.Hour))
	}
	return resp, nil
}

func (f *fakeGrants) Revoke(ctx context.Context, req *pb.RevokeGrantsRequest) (*pb.RevokeGrantsResponse, error) {
	if err := f.check(ctx, req); err != nil {
		return nil, err
	}
	if req.GetSelector().GetCredentialId() == "JTI=denied" {
		return nil, status.Error(codes.PermissionDenied, "hub RBAC does not allow you to delete clusterprofiles.multicluster.x-k8s.io/token")
	}
	return &pb.RevokeGrantsResponse{
		Revoked: []*pb.Grant{testGrant("JTI=1", "fleet/spoke-1", time.Hour)},
		Pending: []*pb.Grant{testGrant("JTI=2", "fleet/spoke-2", time.Hour)},
	}, nil
}

func (f *fakeGrants) received() []proto.Message {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]proto.Message(nil), f.requests...)
}

// The built command against a Grants server over TLS: the token from a
// file or standard input, both outputs, the selector and reason on the
// wire, and the broker's refusal as exit code 1 with its message.
func TestBinary(t *testing.T) {
	goBin, err := exec.LookPath("go")
	require.NoError(t, err, "this test builds the command and needs the go command on PATH")
	bin := filepath.Join(t.TempDir(), "credbroker")
	out, err := exec.Command(goBin, "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "go build: %s", out)

	dir := t.TempDir()
	ca, err := testpki.NewCA("cli.test")
	require.NoError(t, err)
	caFile, err := ca.WriteBundle(dir)
	require.NoError(t, err)
	certFile, keyFile, err := ca.WriteServing(dir, "127.0.0.1")
	require.NoError(t, err)
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	require.NoError(t, err)
	tokenFile := filepath.Join(dir, "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(hubToken+"\n"), 0o600))

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}})))
	fake := &fakeGrants{}
	pb.RegisterGrantsServer(srv, fake)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	otherCA := writeCA(t)

	conn := func(caFile, tokenFile string) []string {
		return []string{"--broker-address", lis.Addr().String(), "--ca-file", caFile, "--token-file", tokenFile, "--timeout", "10s"}
	}
	for _, tc := range []struct {
		name        string
		args        []string
		stdin       string
		wantCode    int
		wantOut     []string
		wantStderr  string
		wantStderr2 string
		wantRequest proto.Message
	}{
		{
			name: "list as a table", args: append([]string{"grants", "list", "--cluster", "fleet/spoke-1"}, conn(caFile, tokenFile)...),
			wantOut:     []string{"CLUSTER ", "CREDENTIAL-ID", "fleet/spoke-1   JTI=1 ", "   59m\n"},
			wantRequest: &pb.ListGrantsRequest{Selector: &pb.GrantSelector{Cluster: &pb.ObjectReference{Namespace: "fleet", Name: "spoke-1"}}},
		},
		{
			name: "list as JSON, token on stdin", args: append([]string{"grants", "list", "-o", "json", "--user", "system:serviceaccount:a:b"}, conn(caFile, "-")...),
			stdin:       hubToken,
			wantOut:     []string{`"credentialId": "JTI=2"`},
			wantRequest: &pb.ListGrantsRequest{Selector: &pb.GrantSelector{Username: "system:serviceaccount:a:b"}},
		},
		{
			name: "revoke", args: append([]string{"grants", "revoke", "--credential-id", "JTI=1", "--reason", "leaked"}, conn(caFile, tokenFile)...),
			wantOut:     []string{"revoked JTI=1 (cluster fleet/spoke-1", "pending JTI=2 (cluster fleet/spoke-2"},
			wantRequest: &pb.RevokeGrantsRequest{Selector: &pb.GrantSelector{CredentialId: "JTI=1"}, Reason: "leaked"},
		},
		{
			name: "revoke refused", args: append([]string{"grants", "revoke", "--credential-id", "JTI=denied"}, conn(caFile, tokenFile)...),
			wantCode: exitFailed, wantStderr: "credbroker: broker " + lis.Addr().String() + ": permission denied: hub RBAC does not allow you to delete", wantStderr2: "; grant it with a Role like deploy/examples/consumer-rbac.yaml",
			wantRequest: &pb.RevokeGrantsRequest{Selector: &pb.GrantSelector{CredentialId: "JTI=denied"}},
		},
		{
			name: "broker not trusted", args: append([]string{"grants", "list"}, conn(otherCA, tokenFile)...),
			wantCode: exitFailed, wantStderr: "unavailable: ", wantStderr2: "check --broker-address and --ca-file",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := len(fake.received())
			cmd := exec.Command(bin, tc.args...)
			cmd.Stdin = strings.NewReader(tc.stdin)
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			err := cmd.Run()
			code := 0
			if err != nil {
				var exitErr *exec.ExitError
				require.ErrorAs(t, err, &exitErr)
				code = exitErr.ExitCode()
			}
			assert.Equal(t, tc.wantCode, code, "stderr: %s", stderr.String())
			for _, want := range tc.wantOut {
				assert.Contains(t, stdout.String(), want)
			}
			assert.Contains(t, stderr.String(), tc.wantStderr)
			assert.Contains(t, stderr.String(), tc.wantStderr2)
			assert.Equal(t, 1, strings.Count(stderr.String(), "\n")+boolInt(stderr.Len() == 0), "one line: %q", stderr.String())
			assert.NotContains(t, stdout.String()+stderr.String(), hubToken)
			got := fake.received()[before:]
			if tc.wantRequest == nil {
				assert.Empty(t, got)
				return
			}
			require.Len(t, got, 1)
			assert.True(t, proto.Equal(tc.wantRequest, got[0]), "got %v", got[0])
		})
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}
