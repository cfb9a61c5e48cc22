package identity_test

import (
	"context"
	"crypto/x509"
	"errors"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/credbroker/credbroker/internal/testing/testpki"
	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/identity"
)

const brokerID = "spiffe://example.test/broker"

// testServer is a gRPC health server on loopback that records the peer ID
// of each call and the error of each failed server-side handshake.
type testServer struct {
	addr string

	mu            sync.Mutex
	peerIDs       []spiffeid.ID
	peerErrs      []error
	handshakeErrs []error
}

func startServer(t *testing.T, creds credentials.TransportCredentials) *testServer {
	t.Helper()
	s := &testServer{}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	s.addr = lis.Addr().String()
	srv := grpc.NewServer(
		grpc.Creds(handshakeRecorder{TransportCredentials: creds, s: s}),
		grpc.UnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			id, chain, err := identity.PeerSVID(ctx)
			if err == nil && len(chain) == 0 {
				err = errors.New("PeerSVID returned an ID without its chain")
			}
			s.mu.Lock()
			if err != nil {
				s.peerErrs = append(s.peerErrs, err)
			} else {
				s.peerIDs = append(s.peerIDs, id)
			}
			s.mu.Unlock()
			return h(ctx, req)
		}),
	)
	healthpb.RegisterHealthServer(srv, health.NewServer())
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return s
}

func (s *testServer) results() (ids []spiffeid.ID, peerErrs, handshakeErrs []error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]spiffeid.ID(nil), s.peerIDs...), append([]error(nil), s.peerErrs...), append([]error(nil), s.handshakeErrs...)
}

type handshakeRecorder struct {
	credentials.TransportCredentials
	s *testServer
}

func (h handshakeRecorder) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	c, info, err := h.TransportCredentials.ServerHandshake(conn)
	if err != nil {
		h.s.mu.Lock()
		h.s.handshakeErrs = append(h.s.handshakeErrs, err)
		h.s.mu.Unlock()
	}
	return c, info, err
}

// check makes one health call to s with creds.
func check(t *testing.T, s *testServer, creds credentials.TransportCredentials) error {
	t.Helper()
	conn, err := grpc.NewClient(s.addr, grpc.WithTransportCredentials(creds))
	require.NoError(t, err)
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	return err
}

// brokerSource is the broker's FileSource, loaded from files like in a Pod.
func brokerSource(t *testing.T, ca *testpki.CA) *identity.FileSource {
	t.Helper()
	dir := t.TempDir()
	certFile, keyFile, err := ca.WriteSVID(dir, brokerID)
	require.NoError(t, err)
	bundleFile, err := ca.WriteBundle(dir)
	require.NoError(t, err)
	src, err := identity.NewFileSource(t.Context(), identity.FileSourceConfig{
		CertFile: certFile, KeyFile: keyFile, BundleFile: bundleFile, TrustDomain: td,
	})
	require.NoError(t, err)
	return src
}

// clientSVID issues an in-memory SVID for id from ca.
func clientSVID(t *testing.T, ca *testpki.CA, id string) *x509svid.SVID {
	t.Helper()
	certPEM, keyPEM, err := ca.IssueSVID(id, time.Hour)
	require.NoError(t, err)
	svid, err := x509svid.Parse(certPEM, keyPEM)
	require.NoError(t, err)
	return svid
}

func TestCredentials(t *testing.T) {
	ca := newCA(t, "example.test")
	otherCA := newCA(t, "other.test")
	bundle := x509bundle.FromX509Authorities(td, []*x509.Certificate{ca.Certificate()})
	src := brokerSource(t, ca)
	srv := startServer(t, identity.ServerCredentials(src, src, td))

	tests := []struct {
		name   string
		svid   *x509svid.SVID
		server string
		// wantClientErr is part of the client's error; wantServerErr part of
		// the server's handshake error. Both empty means success.
		wantClientErr string
		wantServerErr string
	}{
		{name: "agent of the trust domain", svid: clientSVID(t, ca, agentID), server: brokerID},
		{name: "any member of the trust domain", svid: clientSVID(t, ca, "spiffe://example.test/anything"), server: brokerID},
		{
			name:          "client of another trust domain",
			svid:          clientSVID(t, otherCA, "spiffe://other.test/clusterprofile/ns/name"),
			server:        brokerID,
			wantServerErr: `no X.509 bundle for trust domain "other.test"`,
		},
		{
			name:          "client ID in the trust domain signed by a foreign CA",
			svid:          clientSVID(t, otherCA, agentID),
			server:        brokerID,
			wantServerErr: "could not verify leaf certificate",
		},
		{
			name:          "client expects another server ID",
			svid:          clientSVID(t, ca, agentID),
			server:        "spiffe://example.test/not-the-broker",
			wantClientErr: "authentication handshake failed: unexpected ID",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			idsBefore, _, before := srv.results()

			err := check(t, srv, identity.ClientCredentials(tt.svid, bundle, spiffeid.RequireFromString(tt.server)))

			ids, peerErrs, _ := srv.results()
			assert.Empty(t, peerErrs, "every call that reaches a handler has a peer ID")
			if tt.wantClientErr == "" && tt.wantServerErr == "" {
				require.NoError(t, err)
				require.Len(t, ids, len(idsBefore)+1)
				assert.Equal(t, tt.svid.ID, ids[len(ids)-1])
				return
			}
			require.Error(t, err)
			assert.Equal(t, codes.Unavailable, status.Code(err))
			assert.Len(t, ids, len(idsBefore), "no call reached the handler")
			if tt.wantClientErr != "" {
				assert.ErrorContains(t, err, tt.wantClientErr)
			}
			if tt.wantServerErr != "" {
				// With TLS 1.3 the client may finish its side of the
				// handshake before the server refuses, so look at the
				// server's error.
				require.Eventually(t, func() bool {
					_, _, errs := srv.results()
					for _, err := range errs[len(before):] {
						if strings.Contains(err.Error(), tt.wantServerErr) {
							return true
						}
					}
					return false
				}, 5*time.Second, 10*time.Millisecond, "the server refused the handshake with %q", tt.wantServerErr)
			}
		})
	}
}

func TestPeerSVIDWithoutSPIFFE(t *testing.T) {
	// A server over plain credentials has no SPIFFE ID to offer.
	srv := startServer(t, insecure.NewCredentials())
	require.NoError(t, check(t, srv, insecure.NewCredentials()))
	_, peerErrs, _ := srv.results()
	require.Len(t, peerErrs, 1)
	assert.ErrorIs(t, peerErrs[0], errdefs.ErrUnauthenticated)
	assert.Equal(t, codes.Unauthenticated, errdefs.Code(peerErrs[0]))

	_, _, err := identity.PeerSVID(context.Background())
	assert.ErrorIs(t, err, errdefs.ErrUnauthenticated)
}
