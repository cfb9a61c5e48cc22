package identity_test

import (
	"context"
	"fmt"
	"os"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/credbroker/credbroker/internal/testing/testpki"
	"github.com/credbroker/credbroker/pkg/identity"
)

// A broker serves gRPC with the SVID from a mounted volume. Here testpki
// writes the files that a SPIFFE CSI driver would provide in a Pod.
func ExampleFileSource() {
	dir, err := os.MkdirTemp("", "identity-example")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)
	ca, err := testpki.NewCA("example.test")
	if err != nil {
		panic(err)
	}
	certFile, keyFile, err := ca.WriteSVID(dir, "spiffe://example.test/broker")
	if err != nil {
		panic(err)
	}
	bundleFile, err := ca.WriteBundle(dir)
	if err != nil {
		panic(err)
	}

	td := spiffeid.RequireTrustDomainFromString("example.test")
	src, err := identity.NewFileSource(context.Background(), identity.FileSourceConfig{
		CertFile:    certFile,
		KeyFile:     keyFile,
		BundleFile:  bundleFile,
		TrustDomain: td,
	})
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = src.Run(ctx) }() // follow rotations until ctx is done

	srv := grpc.NewServer(grpc.Creds(identity.ServerCredentials(src, src, td)))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	// srv.Serve(listener); handlers call identity.PeerSVID(ctx) to learn
	// which agent is calling.
	defer srv.Stop()

	svid, err := src.GetX509SVID()
	if err != nil {
		panic(err)
	}
	fmt.Println(svid.ID)
	// Output: spiffe://example.test/broker
}
