package e2e

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"
)

// The consumer port does not describe itself to anyone who connects: gRPC
// server reflection is off unless the broker runs with --enable-reflection.
func TestReflectionOffByDefault(t *testing.T) {
	pem, err := os.ReadFile(deployment.CAFile)
	require.NoError(t, err)
	pool := x509.NewCertPool()
	require.True(t, pool.AppendCertsFromPEM(pem))
	conn, err := grpc.NewClient(deployment.Broker.ExchangeAddr(),
		grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12})))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stream, err := reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
	require.NoError(t, err)
	// A Send on a stream the server refused returns io.EOF; Recv has the
	// status.
	_ = stream.Send(&reflectionpb.ServerReflectionRequest{
		MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{},
	})
	resp, err := stream.Recv()
	require.Error(t, err, "the exchange port answered a reflection request: %v", resp)
	assert.Equal(t, codes.Unimplemented, status.Code(err), "error: %v", err)
}
