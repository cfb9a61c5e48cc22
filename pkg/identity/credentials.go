package identity

import (
	"context"
	"crypto/x509"
	"fmt"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffegrpc/grpccredentials"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"

	"github.com/credbroker/credbroker/pkg/errdefs"
)

// ServerCredentials returns mutual-TLS credentials for a gRPC server that
// presents the SVID from svid and accepts any client whose X.509-SVID
// verifies against bundle and is a member of td. A client of another trust
// domain fails the handshake. Which member may do what is the server's
// business after the handshake: see PeerSVID.
//
// The credentials are plain gRPC TLS credentials over go-spiffe's mTLS
// config, so that a handler can read the peer's whole verified chain with
// PeerSVID, and so bound the life of what it serves by the chain's expiry.
func ServerCredentials(svid x509svid.Source, bundle x509bundle.Source, td spiffeid.TrustDomain) credentials.TransportCredentials {
	return credentials.NewTLS(tlsconfig.MTLSServerConfig(svid, bundle, tlsconfig.AuthorizeMemberOf(td)))
}

// ClientCredentials returns mutual-TLS credentials for a gRPC client that
// presents the SVID from svid and accepts only a server whose X.509-SVID
// verifies against bundle and has exactly the ID server. The dial target's
// host name plays no part in verifying the server.
func ClientCredentials(svid x509svid.Source, bundle x509bundle.Source, server spiffeid.ID) credentials.TransportCredentials {
	return grpccredentials.MTLSClientCredentials(svid, bundle, tlsconfig.AuthorizeID(server))
}

// PeerSVID returns the SPIFFE ID and the certificate chain, leaf first, that
// the peer of a gRPC call presented and the handshake of ServerCredentials
// verified, inside a handler (or interceptor) of a server using
// ServerCredentials. The chain is the peer's own; do not modify it. The error wraps
// errdefs.ErrUnauthenticated when the connection carries no X.509-SVID.
func PeerSVID(ctx context.Context) (spiffeid.ID, []*x509.Certificate, error) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return spiffeid.ID{}, nil, fmt.Errorf("identity: the call has no peer: %w", errdefs.ErrUnauthenticated)
	}
	info, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(info.State.PeerCertificates) == 0 {
		return spiffeid.ID{}, nil, fmt.Errorf("identity: the peer has no authenticated SPIFFE ID: %w", errdefs.ErrUnauthenticated)
	}
	chain := info.State.PeerCertificates
	id, err := x509svid.IDFromCert(chain[0])
	if err != nil {
		return spiffeid.ID{}, nil, fmt.Errorf("identity: the peer's certificate is not an X.509-SVID: %v: %w", err, errdefs.ErrUnauthenticated)
	}
	return id, chain, nil
}
