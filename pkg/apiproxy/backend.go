package apiproxy

import (
	"context"
	"errors"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	clientpb "sigs.k8s.io/apiserver-network-proxy/konnectivity-client/proto/client"
	anpagent "sigs.k8s.io/apiserver-network-proxy/pkg/agent"

	"github.com/credbroker/credbroker/pkg/fleet"
)

// BackendConfig configures the agent's side of the data path.
type BackendConfig struct {
	// Credentials are the agent's SPIFFE client credentials, which present
	// its SVID of the moment at every handshake; required.
	Credentials credentials.TransportCredentials
	// APIServer is the spoke API server's host:port, the one address the
	// agent connects the broker's dials to; required.
	APIServer string
	// AgentID is sent to the broker, which replaces it with a name of its
	// own; it shows in the agent's konnectivity logs.
	AgentID string
	// SyncInterval is how soon a closed stream is opened again, such as
	// when the broker ends it at the SVID's expiry. Default 1s.
	SyncInterval time.Duration
	Log          logr.Logger
}

// Backend carries the broker's connections to this spoke's API server: it
// runs a konnectivity agent to each broker address it is given, and
// connects every dial the broker asks for to APIServer, whatever address
// the request names (it refuses any but APIServerAddress).
type Backend struct {
	cfg BackendConfig
}

// NewBackend validates cfg and returns a Backend.
func NewBackend(cfg BackendConfig) (*Backend, error) {
	if cfg.Credentials == nil || cfg.APIServer == "" {
		return nil, errors.New("apiproxy: Credentials and APIServer are required")
	}
	if cfg.SyncInterval <= 0 {
		cfg.SyncInterval = time.Second
	}
	return &Backend{cfg: cfg}, nil
}

// Serve keeps a konnectivity stream to the broker at address until ctx
// ends.
func (b *Backend) Serve(ctx context.Context, address string) {
	cs := (&anpagent.ClientSetConfig{
		Address:         address,
		AgentID:         b.cfg.AgentID,
		SyncInterval:    b.cfg.SyncInterval,
		SyncIntervalCap: 10 * b.cfg.SyncInterval,
		ProbeInterval:   b.cfg.SyncInterval,
		XfrChannelSize:  150,
		DialOptions: []grpc.DialOption{
			grpc.WithTransportCredentials(b.cfg.Credentials),
			grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 30 * time.Second, Timeout: 10 * time.Second, PermitWithoutStream: true}),
			grpc.WithStreamInterceptor(b.onlyAPIServer),
		},
	}).NewAgentClientSet(nil, ctx.Done())
	// One broker replica per address: the agent's fan-out resolves a
	// broker Service to every replica's address.
	cs.SetServerCounter(anpagent.NewResponseBasedCounter(cs))
	cs.Serve()
	b.cfg.Log.Info("data path serving", fleet.LogBroker, address, "apiServer", b.cfg.APIServer)
	<-ctx.Done()
}

// onlyAPIServer rewrites the address of every dial request the broker
// sends: APIServerAddress becomes APIServer, and any other address one
// that cannot be dialled, so that the konnectivity agent answers it with
// a dial failure. Nothing but the spoke API server is ever reached.
func (b *Backend) onlyAPIServer(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	s, err := streamer(ctx, desc, cc, method, opts...)
	if err != nil {
		return nil, err
	}
	return &restrictedStream{ClientStream: s, b: b}, nil
}

type restrictedStream struct {
	grpc.ClientStream
	b *Backend
}

func (s *restrictedStream) RecvMsg(m any) error {
	if err := s.ClientStream.RecvMsg(m); err != nil {
		return err
	}
	if pkt, ok := m.(*clientpb.Packet); ok && pkt.GetType() == clientpb.PacketType_DIAL_REQ {
		s.b.restrict(pkt.GetDialRequest())
	}
	return nil
}

// restrict rewrites req as onlyAPIServer says.
func (b *Backend) restrict(req *clientpb.DialRequest) {
	if req == nil {
		return
	}
	if req.GetProtocol() == "tcp" && req.GetAddress() == APIServerAddress {
		req.Address = b.cfg.APIServer
		return
	}
	b.cfg.Log.Info("data path dial refused: only the spoke API server is reached",
		"protocol", req.GetProtocol(), fleet.LogAddress, req.GetAddress())
	// A Unix socket without a path: net.Dial refuses it at once, without
	// a lookup or a packet.
	req.Protocol, req.Address = "unix", ""
}
