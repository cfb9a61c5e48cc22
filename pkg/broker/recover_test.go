package broker

import (
	"context"
	"net"
	"strings"
	"sync"
	"testing"

	"github.com/go-logr/logr/funcr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// secretInPanic stands for request data that a panic value might carry.
const secretInPanic = "eyJhbGciOiJSUzI1NiJ9.secret-claims.secret-signature"

// panickyHealth panics in both of its handlers, unless the service name is
// "ok".
type panickyHealth struct {
	healthpb.UnimplementedHealthServer
}

func (panickyHealth) Check(_ context.Context, req *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	if req.GetService() == "ok" {
		return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
	}
	panic("handler bug with " + secretInPanic)
}

func (panickyHealth) Watch(*healthpb.HealthCheckRequest, grpc.ServerStreamingServer[healthpb.HealthCheckResponse]) error {
	panic(struct{ token string }{secretInPanic})
}

// A panic in a unary or streaming handler becomes codes.Internal for that
// call only: the server keeps serving the next calls, and the log has the
// method and the stack but not the panic value.
func TestRecoverFromHandlerPanics(t *testing.T) {
	var mu sync.Mutex
	var logged strings.Builder
	log := funcr.New(func(prefix, args string) {
		mu.Lock()
		defer mu.Unlock()
		logged.WriteString(prefix + " " + args + "\n")
	}, funcr.Options{})

	s := grpc.NewServer(grpc.ChainUnaryInterceptor(recoverUnary(log)), grpc.ChainStreamInterceptor(recoverStream(log)))
	healthpb.RegisterHealthServer(s, panickyHealth{})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	served := make(chan error, 1)
	go func() { served <- s.Serve(lis) }()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	client := healthpb.NewHealthClient(conn)

	tests := []struct {
		name string
		call func() error
	}{
		{"unary", func() error {
			_, err := client.Check(t.Context(), &healthpb.HealthCheckRequest{})
			return err
		}},
		{"stream", func() error {
			stream, err := client.Watch(t.Context(), &healthpb.HealthCheckRequest{})
			if err != nil {
				return err
			}
			_, err = stream.Recv()
			return err
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for range 2 {
				st := status.Convert(tt.call())
				assert.Equal(t, codes.Internal, st.Code(), st.Message())
				assert.NotContains(t, st.Message(), secretInPanic)
			}
			resp, err := client.Check(t.Context(), &healthpb.HealthCheckRequest{Service: "ok"})
			require.NoError(t, err, "the server stopped serving after a panic")
			assert.Equal(t, healthpb.HealthCheckResponse_SERVING, resp.GetStatus())
		})
	}

	require.NoError(t, conn.Close())
	s.Stop()
	require.NoError(t, <-served)
	mu.Lock()
	defer mu.Unlock()
	out := logged.String()
	assert.Contains(t, out, `"handler panicked"`)
	assert.Contains(t, out, "/grpc.health.v1.Health/Check")
	assert.Contains(t, out, "/grpc.health.v1.Health/Watch")
	assert.NotContains(t, out, secretInPanic, "the panic value reached the log")
}
