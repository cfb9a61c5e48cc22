package plugin_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/credbroker/credbroker/internal/testing/testpki"
	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// fakeBroker is a TokenExchangeServer that accepts only the bearer token in
// hubToken, records each request, and answers with respond, after the
// refusals queued with refuse.
type fakeBroker struct {
	credbrokerv1alpha1.UnimplementedTokenExchangeServer

	mu       sync.Mutex
	hubToken string
	requests []*credbrokerv1alpha1.ExchangeRequest
	respond  func(*credbrokerv1alpha1.ExchangeRequest) (*credbrokerv1alpha1.ExchangeResponse, error)
	refusals []refusal
}

// refusal is one refused exchange: its code and message, and its
// "retry-after" trailer, none when empty.
type refusal struct {
	code       codes.Code
	msg        string
	retryAfter string
}

func (f *fakeBroker) Exchange(ctx context.Context, req *credbrokerv1alpha1.ExchangeRequest) (*credbrokerv1alpha1.ExchangeResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	md, _ := metadata.FromIncomingContext(ctx)
	if got := md.Get("authorization"); len(got) != 1 || got[0] != "Bearer "+f.hubToken {
		return nil, status.Error(codes.Unauthenticated, "fake broker: wrong or missing authorization metadata")
	}
	if req.GetCluster().GetNamespace() == "" || req.GetCluster().GetName() == "" {
		return nil, status.Error(codes.InvalidArgument, "fake broker: cluster is required")
	}
	f.requests = append(f.requests, proto.CloneOf(req))
	if len(f.refusals) > 0 {
		r := f.refusals[0]
		f.refusals = f.refusals[1:]
		if r.retryAfter != "" {
			_ = grpc.SetTrailer(ctx, metadata.Pairs("retry-after", r.retryAfter))
		}
		return nil, status.Error(r.code, r.msg)
	}
	return f.respond(req)
}

// refuse queues refusals for the next exchanges.
func (f *fakeBroker) refuse(r ...refusal) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.refusals = append(f.refusals, r...)
}

func (f *fakeBroker) setHubToken(s string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.hubToken = s
}

func (f *fakeBroker) received() []*credbrokerv1alpha1.ExchangeRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]*credbrokerv1alpha1.ExchangeRequest(nil), f.requests...)
}

const (
	testHubToken   = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJodWIifQ.c2lnbmF0dXJl"
	testSpokeToken = "spoke-token-123"
)

// testExpiry is what okResponse returns; whole seconds, as in TokenRequest.
var testExpiry = time.Date(2031, 1, 2, 3, 4, 5, 0, time.UTC)

type testBroker struct {
	addr      string
	clientTLS *tls.Config
	fake      *fakeBroker
	tokenFile string
}

// startBroker serves fake over TLS on 127.0.0.1 with a certificate from a
// throwaway CA, and writes testHubToken to a token file.
func startBroker(t *testing.T, respond func(*credbrokerv1alpha1.ExchangeRequest) (*credbrokerv1alpha1.ExchangeResponse, error)) *testBroker {
	t.Helper()
	ca, err := testpki.NewCA("plugin.test")
	require.NoError(t, err)
	certPEM, keyPEM, err := ca.IssueServing([]string{"127.0.0.1"}, time.Hour)
	require.NoError(t, err)
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	require.NoError(t, err)

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{
		Certificates: []tls.Certificate{cert},
		MinVersion:   tls.VersionTLS12,
	})))
	fake := &fakeBroker{hubToken: testHubToken, respond: respond}
	credbrokerv1alpha1.RegisterTokenExchangeServer(srv, fake)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)

	pool := x509.NewCertPool()
	pool.AddCert(ca.Certificate())
	tokenFile := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(testHubToken+"\n"), 0o600))
	return &testBroker{
		addr:      lis.Addr().String(),
		clientTLS: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12},
		fake:      fake,
		tokenFile: tokenFile,
	}
}
