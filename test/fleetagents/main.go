package main

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/credbroker/credbroker/pkg/identity"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "fleetagents:", err)
		os.Exit(1)
	}
}

func run() error {
	var address, dir, bundleFile, trustDomain string
	var timeout time.Duration
	flag.StringVar(&address, "broker-address", "", "the broker's AgentTunnel address, host:port")
	flag.StringVar(&dir, "svid-dir", "", "folder of <name>.crt and <name>.key SVID pairs, one agent each")
	flag.StringVar(&bundleFile, "trust-bundle-file", "", "PEM CA certificates of the trust domain")
	flag.StringVar(&trustDomain, "trust-domain", "", "SPIFFE trust domain of the broker and the agents")
	flag.DurationVar(&timeout, "admit-timeout", 2*time.Minute, "how long the agents may take to be admitted")
	flag.Parse()

	td, err := spiffeid.TrustDomainFromString(trustDomain)
	if err != nil {
		return err
	}
	bundlePEM, err := os.ReadFile(bundleFile)
	if err != nil {
		return err
	}
	bundle, err := x509bundle.Parse(td, bundlePEM)
	if err != nil {
		return err
	}
	certs, err := filepath.Glob(filepath.Join(dir, "*.crt"))
	if err != nil {
		return err
	}
	if len(certs) == 0 {
		return fmt.Errorf("no SVID in %s", dir)
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		// The test closes stdin to stop the fleet.
		_, _ = io.Copy(io.Discard, os.Stdin)
		cancel()
	}()

	var mints atomic.Int64
	var wg sync.WaitGroup
	admitted := make(chan error, len(certs))
	// Handshakes at most 64 at a time, as a fleet's agents would not all
	// start in one millisecond either.
	sem := make(chan struct{}, 64)
	// Reconnects after a broker restart come all at once, as a fleet's
	// would; up to 512 at a time, more than the broker handshakes at once
	// (it makes the rest take turns), few enough that this process still
	// answers the pings of its streams in time.
	reconnects := make(chan struct{}, 512)
	for _, certFile := range certs {
		certPEM, err := os.ReadFile(certFile)
		if err != nil {
			return err
		}
		keyPEM, err := os.ReadFile(strings.TrimSuffix(certFile, ".crt") + ".key")
		if err != nil {
			return err
		}
		svid, err := x509svid.Parse(certPEM, keyPEM)
		if err != nil {
			return fmt.Errorf("%s: %w", certFile, err)
		}
		creds := identity.ClientCredentials(svid, bundle, spiffeid.RequireFromPath(td, "/broker"))
		conn, err := grpc.NewClient(address, grpc.WithTransportCredentials(creds))
		if err != nil {
			return err
		}
		// Closed once the first stream ends: reconnects dial anew.
		defer conn.Close()
		client := pb.NewAgentTunnelClient(conn)
		wg.Go(func() {
			sem <- struct{}{}
			stream, err := admitWithin(ctx, client, timeout)
			<-sem
			admitted <- err
			if err != nil {
				return
			}
			serve(stream, &mints)
			reconnect(ctx, address, creds, reconnects, &mints)
		})
	}
	deadline := time.After(timeout)
	for n := range certs {
		select {
		case err := <-admitted:
			if err != nil {
				return fmt.Errorf("an agent was not admitted (%d of %d were): %w", n, len(certs), err)
			}
		case <-deadline:
			return fmt.Errorf("the agents were not admitted within %s: %d of %d were", timeout, n, len(certs))
		}
	}
	fmt.Printf("admitted %d\n", len(certs))
	<-ctx.Done()
	wg.Wait()
	fmt.Printf("mints %d\n", mints.Load())
	return nil
}

// admitWithin opens a stream and retries until the broker admits it (its
// informer may not know the ClusterProfile yet).
func admitWithin(ctx context.Context, client pb.AgentTunnelClient, timeout time.Duration) (grpc.BidiStreamingClient[pb.AgentFrame, pb.BrokerFrame], error) {
	deadline := time.Now().Add(timeout)
	for {
		stream, err := framework.AdmitFakeAgent(ctx, client, "fleetagents")
		if err == nil {
			return stream, nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return nil, err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// reconnect keeps an agent connected after its first stream ended, until
// ctx ends: each attempt over a new connection, after a jittered,
// doubling backoff, as pkg/tunnel's client does. Attempts take turns in
// sem: a fleet's agents, each on a machine of its own, do not compete for
// one process's cores.
func reconnect(ctx context.Context, address string, creds credentials.TransportCredentials, sem chan struct{}, mints *atomic.Int64) {
	const initial, most = 500 * time.Millisecond, 30 * time.Second
	backoff := initial
	for {
		wait := backoff/2 + mrand.N(backoff/2+1)
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		conn, err := grpc.NewClient(address, grpc.WithTransportCredentials(creds))
		if err != nil {
			return
		}
		sem <- struct{}{}
		stream, err := framework.AdmitFakeAgent(ctx, pb.NewAgentTunnelClient(conn), "fleetagents")
		<-sem
		if err != nil {
			_ = conn.Close()
			backoff = min(2*backoff, most)
			continue
		}
		backoff = initial
		serve(stream, mints)
		_ = conn.Close()
	}
}

// serve answers mint requests until the stream ends. Sends are serialized;
// answers are made at once.
func serve(stream grpc.BidiStreamingClient[pb.AgentFrame, pb.BrokerFrame], mints *atomic.Int64) {
	for {
		f, err := stream.Recv()
		if err != nil {
			return
		}
		req := f.GetMintRequest()
		if req == nil {
			continue // revokes and the rest: nothing was bound, nothing to do
		}
		mints.Add(1)
		out := answer(req)
		out.CorrelationId = f.GetCorrelationId()
		if err := stream.Send(out); err != nil {
			return
		}
	}
}

// answer is what an honest agent would answer: a token for the requested
// ServiceAccount (or fleet-sa/default), with the requested audiences (or the
// spoke's default), living the requested time.
func answer(req *pb.MintRequest) *pb.AgentFrame {
	ns, name := "fleet-sa", "default"
	if sa := req.GetServiceAccount(); sa != nil {
		ns, name = sa.GetNamespace(), sa.GetName()
	}
	aud := req.GetAudiences()
	if len(aud) == 0 {
		aud = []string{"https://kubernetes.default.svc"}
	}
	now := time.Now()
	exp := now.Add(time.Duration(req.GetExpirationSeconds()) * time.Second).Truncate(time.Second)
	jti := make([]byte, 16)
	_, _ = rand.Read(jti)
	payload, _ := json.Marshal(map[string]any{
		"iss": "https://simulated.example", "sub": "system:serviceaccount:" + ns + ":" + name, "aud": aud,
		"exp": exp.Unix(), "iat": now.Unix(), "nbf": now.Unix(), "jti": hex.EncodeToString(jti),
		"kubernetes.io": map[string]any{"namespace": ns, "serviceaccount": map[string]any{"name": name, "uid": "0"}},
	})
	sig := make([]byte, 64)
	_, _ = rand.Read(sig)
	enc := base64.RawURLEncoding.EncodeToString
	tok := enc([]byte(`{"alg":"RS256","kid":"simulated"}`)) + "." + enc(payload) + "." + enc(sig)
	return &pb.AgentFrame{Body: &pb.AgentFrame_MintResponse{MintResponse: &pb.MintResponse{
		Token:          tok,
		ExpirationTime: timestamppb.New(exp),
		ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: name},
	}}}
}
