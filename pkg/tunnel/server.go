package tunnel

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// admittedHeader and admittedUIDHeader are the headers the broker sends when
// it admits a stream; they name the ClusterProfile the agent serves
// ("namespace/name") and the UID of its incarnation.
const (
	admittedHeader    = "credbroker-cluster"
	admittedUIDHeader = "credbroker-cluster-uid"
)

// instanceHeader is the request header in which an agent's Client names
// itself: a random value that it keeps for all its streams to one broker.
// Of the live streams of one agent SPIFFE ID and instance, the broker sends
// new requests down the newest only, so that an agent whose SVID rotated
// can open a stream with the new SVID and drain the old one. An agent can
// so divert work only from streams of its own SPIFFE ID.
const instanceHeader = "credbroker-agent-instance"

// Resolver maps an agent's SPIFFE ID to the one ClusterProfile it may serve.
type Resolver interface {
	ResolveAgent(id spiffeid.ID) (fleet.ClusterRef, error)
}

// ServerConfig configures a Server.
type ServerConfig struct {
	// Resolver admits agents; required.
	Resolver Resolver
	// Peer returns the authenticated SPIFFE ID of a stream's peer and the
	// certificate chain it presented, leaf first; required. The broker
	// passes identity.PeerSVID. A stream lives no longer than the earliest
	// NotAfter of the chain.
	Peer func(ctx context.Context) (spiffeid.ID, []*x509.Certificate, error)
	// Bundles verifies the chains of live streams again when Reverify is
	// called, such as after the trust bundle changed; required.
	Bundles x509bundle.Source
	// MintTimeout bounds one mint request on the stream. Default 10s.
	MintTimeout time.Duration
	// HelloTimeout bounds the wait for an agent's first frame. Default 10s.
	HelloTimeout time.Duration
	// ReturnWait is how long a mint waits, within MintTimeout, for a
	// stream of its cluster when the cluster's last stream ended less than
	// ReturnWait ago: an agent whose stream broke reconnects within its
	// first backoff (250–500 ms by DefaultInitialBackoff). A cluster whose
	// last stream ended longer ago, or that never had one, fails at once
	// with Unavailable. Zero: never wait.
	ReturnWait time.Duration
	// MaxStreamsPerCluster bounds the streams one cluster's agents may hold
	// to this broker; more are refused with ResourceExhausted. Default
	// DefaultMaxStreamsPerCluster.
	MaxStreamsPerCluster int
	// Log receives connection events. Default: discard.
	Log logr.Logger
	// Audit receives one line per agent stream admitted ("agent
	// connected"), ended ("agent disconnected") or refused ("agent
	// refused"), with the agent's SPIFFE ID, instance, cluster, code and
	// reason. Default: discard.
	Audit logr.Logger
	// Clock times the wait for each stream's hello and the end of its
	// identity. Default: the real clock.
	Clock clock.WithDelayedExecution
	// Grants receives the grants the agents report: those of each hello,
	// and every update after it. The broker passes its *grants.Registry.
	// Default: the reports are dropped.
	Grants GrantRegistry
	// OnSessionsChange, when set, is called with a cluster's key after a
	// stream of it was admitted or ended, off the registry's lock; it must
	// not block.
	OnSessionsChange func(types.NamespacedName)
	// Registerer receives the Server's metrics (credbroker_agent_streams,
	// credbroker_connected_clusters, credbroker_agent_mint_duration_seconds,
	// credbroker_agent_revokes_total, credbroker_agent_requests_pending).
	// Nil registers them in a private
	// registry: counted, exposed nowhere.
	Registerer prometheus.Registerer
}

// GrantRegistry keeps the grants the agents report (package grants). It
// bounds what one agent may make it hold: an error, wrapping an errdefs
// sentinel (ErrInvalidArgument or ErrResourceExhausted), refuses the
// report, and the Server closes the stream with it.
type GrantRegistry interface {
	// Hello reports the grants of an agent's hello.
	Hello(ctx context.Context, cluster fleet.ClusterRef, grants []*pb.Grant) error
	// Report applies an agent's report of grants added and removed.
	Report(ctx context.Context, cluster fleet.ClusterRef, u *pb.GrantUpdate) error
}

type noGrants struct{}

func (noGrants) Hello(context.Context, fleet.ClusterRef, []*pb.Grant) error { return nil }

func (noGrants) Report(context.Context, fleet.ClusterRef, *pb.GrantUpdate) error { return nil }

// MaxGrantsPerFrame bounds the grants and credential ids of one hello or
// grant update: the broker closes a stream whose agent sends more. Agents
// split their reports into frames of fewer (the Client sends at most
// grantChunk per frame).
const MaxGrantsPerFrame = 1024

// Server is the broker side of AgentTunnel.
type Server struct {
	pb.UnsafeAgentTunnelServer

	cfg ServerConfig
	// pending counts the mints and revokes waiting for an agent's answer.
	pending atomic.Int64

	mu       sync.RWMutex
	sessions map[types.NamespacedName][]*session
	draining bool // set by Drain and Close; no stream is admitted after
	// gone holds when the last stream of a cluster ended, within
	// ReturnWait, and goneOrder its entries oldest first (forgetGone);
	// arrived, per cluster that mints wait for (awaitReturn), a channel
	// that the next admission of a stream of it closes.
	gone      map[types.NamespacedName]time.Time
	goneOrder []goneAt
	arrived   map[types.NamespacedName]chan struct{}

	metrics *metrics
}

var _ pb.AgentTunnelServer = (*Server)(nil)

// Defaults of ServerConfig.
const (
	DefaultMintTimeout  = 10 * time.Second
	DefaultHelloTimeout = 10 * time.Second
	// DefaultReturnWait covers an agent's first two reconnects after its
	// stream broke (backoffs of 250–500 ms and 500 ms–1 s).
	DefaultReturnWait = 2 * time.Second
	// DefaultMaxStreamsPerCluster is 512: a DaemonSet of agents holds one
	// stream per node to every replica, and two while an agent rotates its
	// SVID, so 200 nodes fit.
	DefaultMaxStreamsPerCluster = 512
)

// NewServer returns a Server with no sessions.
func NewServer(cfg ServerConfig) (*Server, error) {
	if cfg.Resolver == nil || cfg.Peer == nil || cfg.Bundles == nil {
		return nil, errors.New("tunnel: Resolver, Peer and Bundles are required")
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	cfg.MintTimeout = orDefault(cfg.MintTimeout, DefaultMintTimeout)
	cfg.HelloTimeout = orDefault(cfg.HelloTimeout, DefaultHelloTimeout)
	cfg.MaxStreamsPerCluster = orDefault(cfg.MaxStreamsPerCluster, DefaultMaxStreamsPerCluster)
	if cfg.Grants == nil {
		cfg.Grants = noGrants{}
	}
	s := &Server{cfg: cfg, sessions: map[types.NamespacedName][]*session{},
		gone: map[types.NamespacedName]time.Time{}, arrived: map[types.NamespacedName]chan struct{}{}}
	var err error
	if s.metrics, err = newMetrics(cfg.Registerer, s); err != nil {
		return nil, err
	}
	return s, nil
}

// Connect serves one agent stream until the agent leaves, the stream breaks,
// or the agent's ClusterProfile stops accepting it.
func (s *Server) Connect(stream grpc.BidiStreamingServer[pb.AgentFrame, pb.BrokerFrame]) error {
	sess, expires, err := s.admit(stream)
	if err != nil {
		return err
	}
	defer sess.cancel(nil)
	key := sess.cluster.NamespacedName
	defer func() {
		s.remove(sess)
		s.sessionsChanged(key)
	}()
	// The ClusterProfile or the trust bundle may have changed while the
	// hello was awaited, before Revalidate or Reverify could see this
	// session; the session takes requests only once it passed both.
	s.revalidate(sess)
	if _, err := s.verify(sess.agent, sess.chain); err != nil {
		sess.cancel(err)
	}
	if !s.startServing(sess) {
		return s.refuse(sess.log, "agent refused", sess.stream(), context.Cause(sess.ctx))
	}
	s.sessionsChanged(key)
	if err := s.cfg.Grants.Hello(sess.ctx, sess.cluster, sess.hello.GetGrants()); err != nil {
		return s.refuse(sess.log, "agent refused", sess.stream(), fmt.Errorf("agent stream: %w", err))
	}
	// Headers tell the agent it was admitted; the session takes requests
	// already, so an agent that drains its older stream once this one is
	// admitted finds the broker sending new requests here.
	if err := stream.SendHeader(metadata.Pairs(admittedHeader, sess.cluster.String(), admittedUIDHeader, string(sess.cluster.UID))); err != nil {
		return err
	}
	// The stream ends with the agent's identity; the agent reconnects with
	// whatever SVID it holds by then.
	timer := s.cfg.Clock.AfterFunc(expires.Sub(s.cfg.Clock.Now()), func() {
		sess.cancel(fmt.Errorf("agent %s: its SVID expired at %s: %w", sess.agent, expires.UTC().Format(time.RFC3339), errdefs.ErrUnauthenticated))
	})
	defer timer.Stop()
	version := agentVersion(sess.hello.GetAgentVersion())
	sess.log.Info("agent connected", "agentVersion", version, fleet.LogSVIDExpires, expires.UTC().Format(time.RFC3339))
	s.auditAgent("agent connected", sess.stream(), nil, "agentVersion", version, "svidExpires", expires.UTC().Format(time.RFC3339))
	// The stream's end, whichever way it comes; an agent that leaves on its
	// own (its stream ends without error) is OK.
	var endErr error
	defer func() { s.auditAgent("agent disconnected", sess.stream(), endErr) }()
	s.metrics.streams.Inc()
	defer s.metrics.streams.Dec()
	endErr, err = s.serve(stream, sess)
	return err
}

// serve carries the frames of an admitted stream until it ends: it sends
// the frames queued for the agent, and receive takes the agent's. It
// returns the status the stream ends with, and endErr, why it ended, for
// the audit: nil when the agent left on its own.
func (s *Server) serve(stream grpc.BidiStreamingServer[pb.AgentFrame, pb.BrokerFrame], sess *session) (endErr, err error) {
	ctx := stream.Context()
	recvErr := make(chan error, 1)
	go func() { recvErr <- sess.receive(stream, s.cfg.Grants, s.sessionsChanged) }()
	for {
		select {
		case f := <-sess.out:
			if sess.ctx.Err() != nil {
				continue // a closed session sends nothing more: its agent may be refused now
			}
			if err := stream.Send(f); err != nil {
				sess.log.Info("agent stream send failed", fleet.LogErr, err.Error())
				return err, err
			}
		case err := <-recvErr:
			if ctx.Err() != nil {
				// The agent went away; Recv's error says no more, and
				// may come first when both are ready.
				return ctx.Err(), ctx.Err()
			}
			if errors.Is(err, errAgentFrame) {
				sess.log.Info("agent stream closed by broker", fleet.LogErr, err.Error())
				return err, errdefs.ToStatus(err).Err()
			}
			sess.log.Info("agent disconnected", fleet.LogErr, errString(err))
			if err != nil && !errors.Is(err, io.EOF) {
				return err, nil
			}
			return nil, nil
		case <-sess.ctx.Done():
			if ctx.Err() != nil {
				return ctx.Err(), ctx.Err()
			}
			cause := context.Cause(sess.ctx)
			sess.log.Info("agent stream closed by broker", fleet.LogErr, cause.Error())
			return cause, errdefs.ToStatus(cause).Err()
		}
	}
}

// receive delivers answers to their waiting requests, grant updates to
// grants and spoke health reports to the session (then calls
// healthChanged), until the stream ends or the agent sends a frame the
// broker does not take (an error wrapping errAgentFrame).
func (sess *session) receive(stream grpc.BidiStreamingServer[pb.AgentFrame, pb.BrokerFrame], grants GrantRegistry,
	healthChanged func(types.NamespacedName)) error {
	for {
		f, err := stream.Recv()
		if err != nil {
			return err
		}
		if h := f.GetSpokeHealth(); h != nil && f.GetCorrelationId() == "" {
			sess.setSpokeHealth(h)
			healthChanged(sess.cluster.NamespacedName)
			continue
		}
		if u := f.GetGrantUpdate(); u != nil && f.GetCorrelationId() == "" {
			if err := sess.ctx.Err(); err != nil {
				// A closed stream's late updates would undo a newer
				// stream's hello.
				return context.Cause(sess.ctx)
			}
			if n := len(u.GetAdded()) + len(u.GetRemoved()); n > MaxGrantsPerFrame {
				return fmt.Errorf("%w: a grant update of %d grants, more than %d: %w",
					errAgentFrame, n, MaxGrantsPerFrame, errdefs.ErrInvalidArgument)
			}
			if err := grants.Report(sess.ctx, sess.cluster, u); err != nil {
				return fmt.Errorf("%w a grant update that the broker refused: %w", errAgentFrame, err)
			}
			continue
		}
		if f.GetGoodbye() != nil && f.GetCorrelationId() == "" {
			sess.leaving.Store(true)
			sess.log.Info("agent is leaving; no new request goes down its stream")
			continue
		}
		sess.mu.Lock()
		ch, ok := sess.pending[f.GetCorrelationId()]
		delete(sess.pending, f.GetCorrelationId())
		sess.mu.Unlock()
		if !ok {
			// A late answer to a request that timed out, or a stray frame.
			sess.log.V(1).Info("agent frame matches no request", "correlationID", clipAgentString(f.GetCorrelationId(), maxLoggedCorrelationID))
			continue
		}
		ch <- f // buffered; never blocks
	}
}

// errAgentFrame marks a frame that makes the broker close the stream.
var errAgentFrame = errors.New("agent stream: the agent sent")

// orDefault returns v when it is positive, else def: what New does with a
// Config field left zero or set negative.
func orDefault[T ~int | ~int64 | ~float64](v, def T) T {
	if v > 0 {
		return v
	}
	return def
}
