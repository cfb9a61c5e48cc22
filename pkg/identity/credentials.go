package identity

import (
	"context"
	"fmt"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffegrpc/grpccredentials"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc/credentials"

	"github.com/credbroker/credbroker/pkg/errdefs"
)

// ServerCredentials returns mutual-TLS credentials for a gRPC server that
// presents the SVID from svid and accepts any client whose X.509-SVID
// verifies against bundle and is a member of td. A client of another trust
// domain fails the handshake. Which member may do what is the server's
// business after the handshake: see PeerID.
func ServerCredentials(svid x509svid.Source, bundle x509bundle.Source, td spiffeid.TrustDomain) credentials.TransportCredentials {
	return grpccredentials.MTLSServerCredentials(svid, bundle, tlsconfig.AuthorizeMemberOf(td))
}

// ClientCredentials returns mutual-TLS credentials for a gRPC client that
// presents the SVID from svid and accepts only a server whose X.509-SVID
// verifies against bundle and has exactly the ID server. The dial target's
// host name plays no part in verifying the server.
func ClientCredentials(svid x509svid.Source, bundle x509bundle.Source, server spiffeid.ID) credentials.TransportCredentials {
	return grpccredentials.MTLSClientCredentials(svid, bundle, tlsconfig.AuthorizeID(server))
}

// PeerID returns the SPIFFE ID that the peer of a gRPC call authenticated
// with, inside a handler (or interceptor) of a server using
// ServerCredentials. The error wraps
// errdefs.ErrUnauthenticated when the connection carries no SPIFFE ID, such
// as a call over other credentials.
func PeerID(ctx context.Context) (spiffeid.ID, error) {
	id, ok := grpccredentials.PeerIDFromContext(ctx)
	if !ok {
		return spiffeid.ID{}, fmt.Errorf("identity: the peer has no authenticated SPIFFE ID: %w", errdefs.ErrUnauthenticated)
	}
	return id, nil
}
