package client_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/internal/testing/testpki"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// fakeBroker is a TokenExchange server over TLS that mints "spoke-token-N"
// for the hub token "hub-token", valid for lifetime from clock's now, with
// the fake spoke's server and CA.
type fakeBroker struct {
	pb.UnimplementedTokenExchangeServer
	Address   string
	Roots     *x509.CertPool
	TokenFile string // holds "hub-token"
	Spoke     *fakeSpoke

	clock    clock.PassiveClock
	lifetime time.Duration
	srv      *grpc.Server
	dir      string

	mu        sync.Mutex
	exchanges int
	hubTokens []string
	server    *string // when set, answered instead of the spoke's URL
	// refusals are the next answers: ResourceExhausted, with a retry-after
	// trailer of that many seconds when positive, and none when zero.
	refusals []int
	refused  int
}

func startFakeBroker(clk clock.PassiveClock, lifetime time.Duration) (*fakeBroker, error) {
	dir, err := os.MkdirTemp("", "client-test-")
	if err != nil {
		return nil, err
	}
	ca, err := testpki.NewCA("client.test")
	if err != nil {
		return nil, err
	}
	certFile, keyFile, err := ca.WriteServing(dir, "127.0.0.1")
	if err != nil {
		return nil, err
	}
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, err
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca.BundlePEM())
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte("hub-token\n"), 0o600); err != nil {
		return nil, err
	}
	b := &fakeBroker{
		Address: lis.Addr().String(), Roots: roots, TokenFile: tokenFile, Spoke: startFakeSpoke(),
		clock: clk, lifetime: lifetime, dir: dir,
		srv: grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}}))),
	}
	pb.RegisterTokenExchangeServer(b.srv, b)
	go func() { _ = b.srv.Serve(lis) }()
	return b, nil
}

func (b *fakeBroker) Close() {
	b.srv.Stop()
	b.Spoke.Close()
	_ = os.RemoveAll(b.dir)
}

func (b *fakeBroker) Exchange(ctx context.Context, req *pb.ExchangeRequest) (*pb.ExchangeResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	auth := md.Get("authorization")
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(auth) != 1 || !strings.HasPrefix(auth[0], "Bearer ") {
		return nil, status.Error(codes.Unauthenticated, "no hub token")
	}
	b.hubTokens = append(b.hubTokens, strings.TrimPrefix(auth[0], "Bearer "))
	if req.GetCluster().GetName() == "missing" {
		return nil, status.Error(codes.NotFound, "ClusterProfile fleet/missing not found")
	}
	if len(b.refusals) > 0 {
		secs := b.refusals[0]
		b.refusals = b.refusals[1:]
		b.refused++
		if secs > 0 {
			_ = grpc.SetTrailer(ctx, metadata.Pairs("retry-after", fmt.Sprint(secs)))
		}
		return nil, status.Error(codes.ResourceExhausted, "rate limited")
	}
	b.exchanges++
	server := b.Spoke.URL
	if b.server != nil {
		server = *b.server
	}
	return &pb.ExchangeResponse{
		Token:                    fmt.Sprintf("spoke-token-%d", b.exchanges),
		ExpirationTime:           timestamppb.New(b.clock.Now().Add(b.lifetime)),
		Server:                   server,
		CertificateAuthorityData: b.Spoke.CAData,
		CredentialId:             fmt.Sprintf("JTI=%d", b.exchanges),
	}, nil
}

func (b *fakeBroker) Exchanges() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.exchanges
}

// Refuse makes the next exchanges ResourceExhausted, one for each of secs:
// with a retry-after trailer of that many seconds, or none for 0.
func (b *fakeBroker) Refuse(secs ...int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refusals = append(b.refusals, secs...)
}

// Refused counts the exchanges refused so far.
func (b *fakeBroker) Refused() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.refused
}

func (b *fakeBroker) AnswerServer(s string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.server = &s
}

// fakeSpoke is a spoke API server over TLS that lists two namespaces to
// any bearer token except the rejected ones, which get a 401.
type fakeSpoke struct {
	*httptest.Server
	CAData []byte

	mu       sync.Mutex
	seen     []string
	rejected map[string]bool
}

func startFakeSpoke() *fakeSpoke {
	s := &fakeSpoke{rejected: map[string]bool{}}
	s.Server = httptest.NewTLSServer(http.HandlerFunc(s.serve))
	s.CAData = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: s.Certificate().Raw})
	return s
}

func (s *fakeSpoke) serve(w http.ResponseWriter, r *http.Request) {
	tok := strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")
	s.mu.Lock()
	s.seen = append(s.seen, tok)
	rejected := tok == "" || s.rejected[tok]
	s.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	if rejected {
		w.WriteHeader(http.StatusUnauthorized)
		_, _ = w.Write([]byte(`{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Unauthorized","code":401}`))
		return
	}
	_, _ = w.Write([]byte(`{"kind":"NamespaceList","apiVersion":"v1","metadata":{},"items":[` +
		`{"metadata":{"name":"default"}},{"metadata":{"name":"kube-system"}}]}`))
}

func (s *fakeSpoke) Reject(tok string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.rejected[tok] = true
}

func (s *fakeSpoke) Seen() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.seen...)
}
