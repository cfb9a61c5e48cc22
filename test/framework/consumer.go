package framework

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// Consumer is a hub ServiceAccount that calls the broker, with a hub token
// for the broker's audience.
type Consumer struct {
	Namespace, Name string
	Token           string
}

// Username is the consumer's hub username.
func (c Consumer) Username() string {
	return "system:serviceaccount:" + c.Namespace + ":" + c.Name
}

// Context returns ctx carrying the consumer's token as the bearer of every
// call made with it.
func (c Consumer) Context(ctx context.Context) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+c.Token)
}

// NewConsumer creates the hub ServiceAccount namespace/name, lets it
// exchange tokens for the given ClusterProfiles of FleetNamespace, and mints
// it an hour-long hub token for audience.
func (e *Env) NewConsumer(ctx context.Context, namespace, name, audience string, clusterProfiles ...string) (Consumer, error) {
	c := Consumer{Namespace: namespace, Name: name}
	if _, err := e.Hub.CreateServiceAccount(ctx, namespace, name, nil); err != nil {
		return c, err
	}
	for _, cp := range clusterProfiles {
		if err := e.Hub.GrantClusterProfileToken(ctx, FleetNamespace, cp, namespace, name); err != nil {
			return c, err
		}
	}
	var err error
	c.Token, err = e.Hub.Token(ctx, namespace, name, []string{audience}, time.Hour)
	return c, err
}

// OptIn creates the spoke ServiceAccount namespace/name that the given hub
// usernames may get tokens for, and waits until every agent of spoke sees it.
func (d *Deployment) OptIn(ctx context.Context, spoke *Cluster, namespace, name string, allowed ...string) error {
	sa, err := spoke.CreateServiceAccount(ctx, namespace, name, map[string]string{
		"credbroker.io/allowed-subjects": strings.Join(allowed, ","),
	})
	if err != nil {
		return err
	}
	return d.WaitForServiceAccount(ctx, spoke, sa)
}

// ExchangeClient dials a TokenExchange port over TLS, verifying it with the
// deployment's CA, with opts besides. Close the returned connection when
// done.
func (d *Deployment) ExchangeClient(addr string, opts ...grpc.DialOption) (pb.TokenExchangeClient, *grpc.ClientConn, error) {
	pem, err := os.ReadFile(d.CAFile)
	if err != nil {
		return nil, nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, nil, fmt.Errorf("framework: no certificate in %s", d.CAFile)
	}
	conn, err := grpc.NewClient(addr, append([]grpc.DialOption{
		grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12})),
	}, opts...)...)
	if err != nil {
		return nil, nil, err
	}
	return pb.NewTokenExchangeClient(conn), conn, nil
}
