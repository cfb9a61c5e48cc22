package bench

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"os"
	"strconv"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/credbroker/credbroker/test/framework"
)

// echoCommand, as the test binary's first argument, makes it serve the echo
// baseline instead of running tests: `bench.test echo-server ADDR CERT KEY
// SIZE`. The echo is its own process, as the broker is.
const echoCommand = "echo-server"

// echoMethod is the echo's one unary method. It answers every request with
// the same payload: SIZE bytes, the size of an exchange answer.
const echoMethod = "/credbroker.bench.Echo/Echo"

var echoService = grpc.ServiceDesc{
	ServiceName: "credbroker.bench.Echo",
	HandlerType: (*any)(nil),
	Methods: []grpc.MethodDesc{{
		MethodName: "Echo",
		Handler: func(srv any, _ context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
			if err := dec(new(wrapperspb.BytesValue)); err != nil {
				return nil, err
			}
			return srv.(*wrapperspb.BytesValue), nil
		},
	}},
}

// serveEcho serves the echo on args ADDR CERT KEY SIZE until killed.
func serveEcho(args []string) int {
	if len(args) != 4 {
		return fail(fmt.Errorf("usage: %s ADDR CERT KEY SIZE", echoCommand))
	}
	size, err := strconv.Atoi(args[3])
	if err != nil {
		return fail(err)
	}
	cert, err := tls.LoadX509KeyPair(args[1], args[2])
	if err != nil {
		return fail(err)
	}
	lis, err := net.Listen("tcp", args[0])
	if err != nil {
		return fail(err)
	}
	srv := grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12})))
	srv.RegisterService(&echoService, &wrapperspb.BytesValue{Value: make([]byte, size)})
	if err := srv.Serve(lis); err != nil {
		return fail(err)
	}
	return 0
}

// startEcho runs the echo process with the brokers' serving certificate and
// returns a dialled connection per worker once it answers.
func startEcho(ctx context.Context, size, workers int) (*framework.Process, []*grpc.ClientConn, error) {
	addr, err := framework.FreeAddr()
	if err != nil {
		return nil, nil, err
	}
	cert, key := deployment.ServingCertFiles()
	p, err := framework.StartProcess(os.Args[0], echoCommand, addr, cert, key, strconv.Itoa(size))
	if err != nil {
		return nil, nil, err
	}
	conns := make([]*grpc.ClientConn, workers)
	for i := range conns {
		if _, conns[i], err = deployment.ExchangeClient(addr); err != nil {
			p.Stop()
			return nil, nil, err
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := echo(ctx, conns[0])
		if err == nil {
			return p, conns, nil
		}
		if time.Now().After(deadline) {
			p.Stop()
			return nil, nil, fmt.Errorf("echo did not answer: %w\n%s", err, p.Output())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func echo(ctx context.Context, conn *grpc.ClientConn) error {
	return conn.Invoke(ctx, echoMethod, &wrapperspb.BytesValue{}, new(wrapperspb.BytesValue))
}
