package fakeworkload

import (
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"

	"github.com/spiffe/go-spiffe/v2/proto/spiffe/workload"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// SVID is one X.509-SVID to serve, as PEM: the certificates leaf first and
// the PKCS#8 key.
type SVID struct {
	CertPEM, KeyPEM []byte
}

// Server is a fake Workload API. Start it with Start, set what it serves
// with Set, and Stop it.
type Server struct {
	workload.UnimplementedSpiffeWorkloadAPIServer

	dir  string
	addr string
	srv  *grpc.Server

	mu      sync.Mutex
	current *workload.X509SVIDResponse
	version chan struct{} // closed and replaced on every Set
}

// Start serves the Workload API on a unix socket in a new temporary
// directory (short, to fit the socket path limit). It serves nothing until
// Set is called: clients wait.
func Start() (*Server, error) {
	dir, err := os.MkdirTemp("", "wl")
	if err != nil {
		return nil, err
	}
	path := filepath.Join(dir, "api.sock")
	lis, err := net.Listen("unix", path)
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	s := &Server{dir: dir, addr: "unix://" + path, srv: grpc.NewServer(), version: make(chan struct{})}
	workload.RegisterSpiffeWorkloadAPIServer(s.srv, s)
	go func() { _ = s.srv.Serve(lis) }()
	return s, nil
}

// Addr is the socket's address for workloadapi.WithAddr and
// --spiffe-endpoint-socket: unix:///….
func (s *Server) Addr() string { return s.addr }

// Stop stops the server and removes its socket.
func (s *Server) Stop() {
	s.srv.Stop()
	_ = os.RemoveAll(s.dir)
}

// Set replaces what the server serves, in order, with bundlePEM as the
// bundle of each SVID's trust domain, and pushes it to every client.
func (s *Server) Set(bundlePEM []byte, svids ...SVID) error {
	bundle, err := derOf(bundlePEM, "CERTIFICATE")
	if err != nil {
		return fmt.Errorf("fakeworkload: bundle: %w", err)
	}
	resp := &workload.X509SVIDResponse{}
	for i, sv := range svids {
		cert, err := derOf(sv.CertPEM, "CERTIFICATE")
		if err != nil {
			return fmt.Errorf("fakeworkload: SVID %d: %w", i, err)
		}
		key, err := derOf(sv.KeyPEM, "PRIVATE KEY")
		if err != nil {
			return fmt.Errorf("fakeworkload: SVID %d key: %w", i, err)
		}
		id, err := idOf(sv.CertPEM)
		if err != nil {
			return fmt.Errorf("fakeworkload: SVID %d: %w", i, err)
		}
		resp.Svids = append(resp.Svids, &workload.X509SVID{SpiffeId: id, X509Svid: cert, X509SvidKey: key, Bundle: bundle})
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.current = resp
	close(s.version)
	s.version = make(chan struct{})
	return nil
}

// FetchX509SVID sends what is set, then every change, until the client
// leaves.
func (s *Server) FetchX509SVID(_ *workload.X509SVIDRequest, stream grpc.ServerStreamingServer[workload.X509SVIDResponse]) error {
	md, _ := metadata.FromIncomingContext(stream.Context())
	if len(md.Get("workload.spiffe.io")) == 0 {
		return status.Error(codes.InvalidArgument, "security header missing from request")
	}
	for {
		s.mu.Lock()
		resp, next := s.current, s.version
		s.mu.Unlock()
		if resp != nil {
			if err := stream.Send(resp); err != nil {
				return err
			}
		}
		select {
		case <-next:
		case <-stream.Context().Done():
			return nil
		}
	}
}

// derOf returns the DER of every PEM block of type typ in data, concatenated.
func derOf(data []byte, typ string) ([]byte, error) {
	var out []byte
	for {
		var b *pem.Block
		b, data = pem.Decode(data)
		if b == nil {
			break
		}
		if b.Type == typ {
			out = append(out, b.Bytes...)
		}
	}
	if len(out) == 0 {
		return nil, errors.New("no " + typ + " PEM block")
	}
	return out, nil
}

func idOf(certPEM []byte) (string, error) {
	b, _ := pem.Decode(certPEM)
	if b == nil {
		return "", errors.New("no PEM certificate")
	}
	id, err := idFromDER(b.Bytes)
	if err != nil {
		return "", err
	}
	return id.String(), nil
}

func idFromDER(der []byte) (spiffeid.ID, error) {
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return spiffeid.ID{}, err
	}
	return x509svid.IDFromCert(cert)
}
