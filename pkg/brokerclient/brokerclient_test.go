package brokerclient_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/credbroker/credbroker/internal/testing/testpki"
	"github.com/credbroker/credbroker/pkg/brokerclient"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// flakyBroker fails the first calls with the codes in fail, then answers.
type flakyBroker struct {
	pb.UnimplementedTokenExchangeServer
	fail  []codes.Code
	calls atomic.Int32
}

func (f *flakyBroker) Exchange(context.Context, *pb.ExchangeRequest) (*pb.ExchangeResponse, error) {
	n := int(f.calls.Add(1))
	if n <= len(f.fail) {
		return nil, status.Error(f.fail[n-1], "not now")
	}
	return &pb.ExchangeResponse{CredentialId: "JTI=ok"}, nil
}

// serve starts a TLS broker with fake and returns its address and the
// credentials that verify it.
func serve(t *testing.T, fake *flakyBroker) (string, credentials.TransportCredentials) {
	t.Helper()
	dir := t.TempDir()
	ca, err := testpki.NewCA("brokerclient.test")
	require.NoError(t, err)
	bundle, err := ca.WriteBundle(dir)
	require.NoError(t, err)
	certFile, keyFile, err := ca.WriteServing(dir, "127.0.0.1")
	require.NoError(t, err)
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	require.NoError(t, err)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}})))
	pb.RegisterTokenExchangeServer(srv, fake)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)

	pemData, err := os.ReadFile(bundle)
	require.NoError(t, err)
	pool := x509.NewCertPool()
	require.True(t, pool.AppendCertsFromPEM(pemData))
	creds, err := brokerclient.TLSCredentials(&tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12})
	require.NoError(t, err)
	return lis.Addr().String(), creds
}

// A replica that drains or restarts answers Unavailable; the consumer's call
// is tried once more, and fails only if that fails too. Other codes are the
// caller's to act on and are not retried.
func TestDialRetriesUnavailableOnce(t *testing.T) {
	tests := []struct {
		name      string
		fail      []codes.Code
		wantCode  codes.Code
		wantCalls int32
	}{
		{"answers at once", nil, codes.OK, 1},
		{"one Unavailable is retried", []codes.Code{codes.Unavailable}, codes.OK, 2},
		{"a second Unavailable is the caller's", []codes.Code{codes.Unavailable, codes.Unavailable}, codes.Unavailable, 2},
		{"PermissionDenied is not retried", []codes.Code{codes.PermissionDenied}, codes.PermissionDenied, 1},
		{"DeadlineExceeded is not retried", []codes.Code{codes.DeadlineExceeded}, codes.DeadlineExceeded, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fake := &flakyBroker{fail: tt.fail}
			addr, creds := serve(t, fake)
			conn, err := brokerclient.Dial(addr, creds, "test")
			require.NoError(t, err)
			t.Cleanup(func() { _ = conn.Close() })
			_, err = pb.NewTokenExchangeClient(conn).Exchange(t.Context(), &pb.ExchangeRequest{})
			assert.Equal(t, tt.wantCode, status.Code(err), "%v", err)
			assert.Equal(t, tt.wantCalls, fake.calls.Load())
		})
	}
}

func TestRequestNormalize(t *testing.T) {
	tests := []struct {
		name    string
		req     brokerclient.Request
		want    brokerclient.Request
		wantErr string
	}{
		{name: "defaults", want: brokerclient.Request{Timeout: brokerclient.DefaultTimeout}},
		{name: "kept", req: brokerclient.Request{Audiences: []string{"a", "b"}, ExpirationSeconds: 600, Timeout: time.Second},
			want: brokerclient.Request{Audiences: []string{"a", "b"}, ExpirationSeconds: 600, Timeout: time.Second}},
		{name: "empty audience", req: brokerclient.Request{Audiences: []string{"a", ""}}, wantErr: `audience "" is empty or has surrounding spaces`},
		{name: "padded audience", req: brokerclient.Request{Audiences: []string{" a"}}, wantErr: `audience " a" is empty or has surrounding spaces`},
		{name: "negative expiration", req: brokerclient.Request{ExpirationSeconds: -1}, wantErr: "expiration seconds -1 is negative"},
		{name: "negative timeout", req: brokerclient.Request{Timeout: -time.Second}, wantErr: "timeout -1s is negative"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tt.req.Normalize()
			if tt.wantErr != "" {
				assert.EqualError(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
		})
	}
}

// The normalized request owns its audiences: the caller's slice may change.
func TestRequestNormalizeCopiesAudiences(t *testing.T) {
	audiences := []string{"a"}
	got, err := brokerclient.Request{Audiences: audiences}.Normalize()
	require.NoError(t, err)
	audiences[0] = "changed"
	assert.Equal(t, []string{"a"}, got.Audiences)
}
