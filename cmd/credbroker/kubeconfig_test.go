package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"net"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/credbroker/credbroker/internal/testing/testpki"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

const spokeToken = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzcG9rZSJ9.c3Bva2UtdG9rZW4"

// fakeExchange answers every exchange of the hub token with spokeToken,
// a server and a CA, and refuses fleet/denied.
type fakeExchange struct {
	pb.UnimplementedTokenExchangeServer
	got []*pb.ExchangeRequest
}

func (f *fakeExchange) Exchange(ctx context.Context, req *pb.ExchangeRequest) (*pb.ExchangeResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	if got := md.Get("authorization"); len(got) != 1 || got[0] != "Bearer "+hubToken {
		return nil, status.Error(codes.Unauthenticated, "wrong token")
	}
	f.got = append(f.got, req)
	if req.GetCluster().GetName() == "denied" {
		return nil, status.Error(codes.PermissionDenied, `hub RBAC does not allow "system:serviceaccount:argocd:controller" to create `+
			`multicluster.x-k8s.io/clusterprofiles/token "denied" in namespace "fleet": permission denied`)
	}
	return &pb.ExchangeResponse{Token: spokeToken, Server: "https://spoke-1.example:6443",
		CertificateAuthorityData: []byte("-----BEGIN CERTIFICATE-----\nspoke\n-----END CERTIFICATE-----\n"),
		ExpirationTime:           timestamppb.Now()}, nil
}

func startExchange(t *testing.T) (addr, caFile, tokenFile string, fake *fakeExchange) {
	t.Helper()
	dir := t.TempDir()
	ca, err := testpki.NewCA("cli.test")
	require.NoError(t, err)
	caFile, err = ca.WriteBundle(dir)
	require.NoError(t, err)
	certFile, keyFile, err := ca.WriteServing(dir, "127.0.0.1")
	require.NoError(t, err)
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	require.NoError(t, err)
	tokenFile = filepath.Join(dir, "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(hubToken), 0o600))
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}})))
	fake = &fakeExchange{}
	pb.RegisterTokenExchangeServer(srv, fake)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return lis.Addr().String(), caFile, tokenFile, fake
}

// The kubeconfig carries the broker's server and CA, execs the plugin with
// the plugin's own flags and provideClusterInfo, and holds no token.
func TestKubeconfig(t *testing.T) {
	addr, caFile, tokenFile, fake := startExchange(t)
	// Relative names become absolute: the plugin runs wherever kubectl does.
	t.Chdir(filepath.Dir(caFile))
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"kubeconfig", "--cluster", "fleet/spoke-1", "--broker", addr,
		"--ca-file", filepath.Base(caFile), "--token-file", tokenFile, "--service-account", "apps/reader",
		"--audience", "a", "--audience", "b",
		"--plugin-path", "/opt/bin/credbroker-plugin"}, streams{out: &stdout, err: &stderr})
	require.Equal(t, exitOK, code, stderr.String())
	assert.NotContains(t, stdout.String()+stderr.String(), spokeToken)
	assert.NotContains(t, stdout.String()+stderr.String(), hubToken)
	require.Len(t, fake.got, 1)
	assert.Equal(t, "spoke-1", fake.got[0].GetCluster().GetName())
	assert.Equal(t, "reader", fake.got[0].GetServiceAccount().GetName())

	kc, err := clientcmd.Load(stdout.Bytes())
	require.NoError(t, err)
	require.NoError(t, clientcmd.Validate(*kc))
	assert.Equal(t, "fleet/spoke-1", kc.CurrentContext)
	c := kc.Clusters["fleet/spoke-1"]
	require.NotNil(t, c)
	assert.Equal(t, "https://spoke-1.example:6443", c.Server)
	assert.Contains(t, string(c.CertificateAuthorityData), "spoke")
	u := kc.AuthInfos["fleet/spoke-1"]
	require.NotNil(t, u)
	assert.Empty(t, u.Token)
	assert.Empty(t, u.TokenFile)
	require.NotNil(t, u.Exec)
	assert.Equal(t, "/opt/bin/credbroker-plugin", u.Exec.Command)
	assert.Equal(t, "client.authentication.k8s.io/v1", u.Exec.APIVersion)
	assert.True(t, u.Exec.ProvideClusterInfo)
	assert.Equal(t, []string{"--broker-address", addr, "--ca-file", caFile, "--token-file", tokenFile,
		"--cluster", "fleet/spoke-1", "--service-account", "apps/reader", "--audience", "a,b"}, u.Exec.Args,
		"the plugin takes each flag once, so the audiences go in one")
}

func TestKubeconfigToFile(t *testing.T) {
	addr, caFile, tokenFile, _ := startExchange(t)
	out := filepath.Join(t.TempDir(), "kubeconfig")
	require.NoError(t, os.WriteFile(out, []byte("old"), 0o644))
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"kubeconfig", "--cluster", "fleet/spoke-1", "--broker-address", addr,
		"--ca-file", caFile, "--token-file", tokenFile, "-o", out}, streams{out: &stdout, err: &stderr})
	require.Equal(t, exitOK, code, stderr.String())
	assert.Empty(t, stdout.String())
	fi, err := os.Stat(out)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
	kc, err := clientcmd.LoadFromFile(out)
	require.NoError(t, err)
	assert.Equal(t, "credbroker-plugin", kc.AuthInfos["fleet/spoke-1"].Exec.Command)
}

func TestKubeconfigErrors(t *testing.T) {
	addr, caFile, tokenFile, _ := startExchange(t)
	conn := []string{"--broker-address", addr, "--ca-file", caFile, "--token-file", tokenFile}
	for _, tc := range []struct {
		name     string
		args     []string
		wantCode int
		want     string
	}{
		{name: "no cluster", args: conn, wantCode: exitUsage, want: "--cluster <namespace>/<name> is required"},
		{name: "bad cluster", args: append([]string{"--cluster", "x"}, conn...), wantCode: exitUsage, want: "--cluster: "},
		{name: "token on stdin", args: []string{"--cluster", "a/b", "--broker-address", addr, "--ca-file", caFile, "--token-file", "-"},
			wantCode: exitUsage, want: "standard input will not do"},
		{name: "denied", args: append([]string{"--cluster", "fleet/denied"}, conn...), wantCode: exitFailed,
			want: `credbroker: broker ` + addr + `: permission denied: hub RBAC does not allow "system:serviceaccount:argocd:controller" to create ` +
				`multicluster.x-k8s.io/clusterprofiles/token "denied" in namespace "fleet"; grant it with a Role like deploy/examples/consumer-rbac.yaml` + "\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			code := run(context.Background(), append([]string{"kubeconfig"}, tc.args...), streams{out: &stdout, err: &stderr})
			assert.Equal(t, tc.wantCode, code)
			assert.Contains(t, stderr.String(), tc.want)
			assert.Empty(t, stdout.String())
		})
	}
}
