package tunnel

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/token"
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
	// MaxStreamsPerCluster bounds the streams one cluster's agents may hold
	// to this broker; more are refused with ResourceExhausted. Default 512:
	// a DaemonSet of agents holds one stream per node to every replica, and
	// two while an agent rotates its SVID, so 200 nodes fit.
	MaxStreamsPerCluster int
	// Log receives connection events. Default: discard.
	Log logr.Logger
	// Audit receives one line per agent stream admitted ("agent
	// connected"), ended ("agent disconnected") or refused ("agent
	// refused"), with the agent's SPIFFE ID, instance, cluster, code and
	// reason. Default: discard.
	Audit logr.Logger
	// Clock times the end of each stream's identity. Default: the real clock.
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

func (noGrants) Hello(context.Context, fleet.ClusterRef, []*pb.Grant) error      { return nil }
func (noGrants) Report(context.Context, fleet.ClusterRef, *pb.GrantUpdate) error { return nil }

// MaxGrantsPerFrame bounds the grants and credential ids of one hello or
// grant update: the broker closes a stream whose agent sends more. Agents
// split their reports into frames of fewer (the Client sends at most
// grantChunk per frame).
const MaxGrantsPerFrame = 1024

// Server is the broker side of AgentTunnel.
type Server struct {
	pb.UnsafeAgentTunnelServer

	cfg  ServerConfig
	next atomic.Uint64 // round robin over a cluster's sessions
	// pending counts the mints and revokes waiting for an agent's answer.
	pending atomic.Int64

	mu       sync.RWMutex
	sessions map[types.NamespacedName][]*session
	draining bool // set by Drain and Close; no stream is admitted after

	metrics *metrics
}

var _ pb.AgentTunnelServer = (*Server)(nil)

// NewServer returns a Server with no sessions.
func NewServer(cfg ServerConfig) (*Server, error) {
	if cfg.Resolver == nil || cfg.Peer == nil || cfg.Bundles == nil {
		return nil, errors.New("tunnel: Resolver, Peer and Bundles are required")
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	if cfg.MintTimeout <= 0 {
		cfg.MintTimeout = 10 * time.Second
	}
	if cfg.HelloTimeout <= 0 {
		cfg.HelloTimeout = 10 * time.Second
	}
	if cfg.MaxStreamsPerCluster <= 0 {
		cfg.MaxStreamsPerCluster = 512
	}
	if cfg.Grants == nil {
		cfg.Grants = noGrants{}
	}
	s := &Server{cfg: cfg, sessions: map[types.NamespacedName][]*session{}}
	var err error
	if s.metrics, err = newMetrics(cfg.Registerer, s); err != nil {
		return nil, err
	}
	return s, nil
}

// session is one live Connect stream.
type session struct {
	agent    spiffeid.ID
	instance string              // the agent's instanceHeader; empty when it sent none
	chain    []*x509.Certificate // the agent's SVID, leaf first
	hello    *pb.Hello           // server and CA the agent advertised
	cluster  fleet.ClusterRef
	out      chan *pb.BrokerFrame
	ctx      context.Context
	cancel   context.CancelCauseFunc

	mu      sync.Mutex
	pending map[string]chan *pb.AgentFrame

	// leaving is set when the agent says goodbye: no new request goes down
	// the stream, and the agent closes it once it has answered those in
	// flight.
	leaving atomic.Bool
	// spokeHealth is the agent's last report of its spoke's /readyz, its
	// message clipped; nil when it reported none.
	spokeHealth atomic.Pointer[pb.SpokeHealth]
}

// maxSpokeHealthMessage bounds the message of an agent's spoke health
// report that the broker keeps, in bytes: it reaches the ClusterProfile's
// condition, whose message the API server caps at 32 KiB.
const maxSpokeHealthMessage = 512

// setSpokeHealth records an agent's report of its spoke's /readyz.
func (sess *session) setSpokeHealth(h *pb.SpokeHealth) {
	if h == nil {
		sess.spokeHealth.Store(nil)
		return
	}
	sess.spokeHealth.Store(&pb.SpokeHealth{Ready: h.GetReady(), Message: clipAgentString(h.GetMessage(), maxSpokeHealthMessage)})
}

// Admission is what the broker admitted a stream's peer as.
type Admission struct {
	// Agent is the peer's SPIFFE ID.
	Agent spiffeid.ID
	// Cluster is the one ClusterProfile incarnation the agent serves.
	Cluster fleet.ClusterRef
	// Expires is when the peer's SVID, or a CA of its chain, expires: the
	// stream must end then.
	Expires time.Time
	chain   []*x509.Certificate
}

// Admit judges the peer of a stream whose context is ctx, as Connect does:
// its SVID must verify against the current trust bundle, by the clock of
// now (a connection outlives the handshake that verified it), and map to a
// ClusterProfile. Another stream service on the agent port, such as the
// data path, admits its streams with it, logs and audits nothing else, and
// calls Readmit while the stream lives.
func (s *Server) Admit(ctx context.Context) (Admission, error) {
	id, chain, err := s.cfg.Peer(ctx)
	if err != nil {
		return Admission{}, fmt.Errorf("agent stream: %w", err)
	}
	adm := Admission{Agent: id, chain: chain}
	if adm.Expires, err = s.verify(id, chain); err != nil {
		return adm, err
	}
	if adm.Cluster, err = s.cfg.Resolver.ResolveAgent(id); err != nil {
		return adm, fmt.Errorf("agent %s: %w", id, err)
	}
	return adm, nil
}

// Readmit reports why a stream admitted as adm may no longer live, or nil:
// its SVID no longer verifies against the trust bundle of now, or its
// agent no longer maps to the same ClusterProfile incarnation.
func (s *Server) Readmit(adm Admission) error {
	if _, err := s.verify(adm.Agent, adm.chain); err != nil {
		return err
	}
	return s.stillServes(adm.Agent, adm.Cluster)
}

// Connect serves one agent stream until the agent leaves, the stream breaks,
// or the agent's ClusterProfile stops accepting it.
func (s *Server) Connect(stream grpc.BidiStreamingServer[pb.AgentFrame, pb.BrokerFrame]) error {
	ctx := stream.Context()
	instance := instanceOf(ctx)
	adm, err := s.Admit(ctx)
	if err != nil {
		if adm.Agent.IsZero() {
			s.auditAgent("agent refused", "", instance, "", err)
		} else {
			s.cfg.Log.Info("agent refused", "agent", adm.Agent.String(), "reason", err.Error())
			s.auditAgent("agent refused", adm.Agent.String(), instance, "", err)
		}
		return errdefs.ToStatus(err).Err()
	}
	id, chain, expires, cluster := adm.Agent, adm.chain, adm.Expires, adm.Cluster
	log := s.cfg.Log.WithValues("agent", id.String(), "cluster", cluster.String())

	hello, err := recvHello(ctx, stream, s.cfg.HelloTimeout)
	if err != nil {
		log.Info("agent stream closed before hello", "reason", err.Error())
		s.auditAgent("agent refused", id.String(), instance, cluster.String(), err)
		return errdefs.ToStatus(err).Err()
	}
	if n := len(hello.GetGrants()); n > MaxGrantsPerFrame {
		err := fmt.Errorf("agent stream: the hello carries %d grants, more than %d; send the rest as grant updates: %w",
			n, MaxGrantsPerFrame, errdefs.ErrInvalidArgument)
		log.Info("agent refused", "reason", err.Error())
		s.auditAgent("agent refused", id.String(), instance, cluster.String(), err)
		return errdefs.ToStatus(err).Err()
	}
	sctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	sess := &session{
		agent: id, instance: instance, chain: chain, cluster: cluster, hello: hello,
		out: make(chan *pb.BrokerFrame, 16), ctx: sctx, cancel: cancel,
		pending: map[string]chan *pb.AgentFrame{},
	}
	sess.setSpokeHealth(hello.GetSpokeHealth())
	// The session takes requests before the agent learns it was admitted:
	// an agent that drains its older stream once this one is admitted finds
	// the broker already sending new requests here.
	if err := s.add(sess); err != nil {
		log.Info("agent refused", "reason", err.Error())
		s.auditAgent("agent refused", id.String(), instance, cluster.String(), err)
		return errdefs.ToStatus(err).Err()
	}
	defer func() {
		s.remove(sess)
		s.sessionsChanged(cluster.NamespacedName)
	}()
	s.sessionsChanged(cluster.NamespacedName)
	// Headers tell the agent it was admitted.
	if err := stream.SendHeader(metadata.Pairs(admittedHeader, cluster.String(), admittedUIDHeader, string(cluster.UID))); err != nil {
		return err
	}
	// The ClusterProfile or the trust bundle may have changed while the
	// hello was awaited, before Revalidate or Reverify could see this
	// session.
	s.revalidate(sess)
	if _, err := s.verify(id, chain); err != nil {
		sess.cancel(err)
	}
	if sctx.Err() == nil {
		if err := s.cfg.Grants.Hello(sctx, cluster, hello.GetGrants()); err != nil {
			err = fmt.Errorf("agent stream: %w", err)
			log.Info("agent refused", "reason", err.Error())
			s.auditAgent("agent refused", id.String(), instance, cluster.String(), err)
			return errdefs.ToStatus(err).Err()
		}
	}
	// The stream ends with the agent's identity; the agent reconnects with
	// whatever SVID it holds by then.
	timer := s.cfg.Clock.AfterFunc(expires.Sub(s.cfg.Clock.Now()), func() {
		sess.cancel(fmt.Errorf("agent %s: its SVID expired at %s: %w", id, expires.UTC().Format(time.RFC3339), errdefs.ErrUnauthenticated))
	})
	defer timer.Stop()
	version := agentVersion(hello.GetAgentVersion())
	log.Info("agent connected", "agentVersion", version, "svidExpires", expires.UTC().Format(time.RFC3339))
	s.auditAgent("agent connected", id.String(), instance, cluster.String(), nil,
		"agentVersion", version, "svidExpires", expires.UTC().Format(time.RFC3339))
	// The stream's end, whichever way it comes; an agent that leaves on its
	// own (its stream ends without error) is OK.
	var endErr error
	defer func() { s.auditAgent("agent disconnected", id.String(), instance, cluster.String(), endErr) }()
	s.metrics.streams.Inc()
	defer s.metrics.streams.Dec()

	recvErr := make(chan error, 1)
	go func() { recvErr <- sess.receive(stream, s.cfg.Grants, s.sessionsChanged, log) }()
	for {
		select {
		case f := <-sess.out:
			if err := stream.Send(f); err != nil {
				log.Info("agent stream send failed", "err", err.Error())
				endErr = err
				return err
			}
		case err := <-recvErr:
			if errors.Is(err, errAgentFrame) {
				log.Info("agent stream closed by broker", "reason", err.Error())
				endErr = err
				return errdefs.ToStatus(err).Err()
			}
			log.Info("agent disconnected", "reason", errString(err))
			if err != nil && !errors.Is(err, io.EOF) {
				endErr = err
			}
			return nil
		case <-sctx.Done():
			if ctx.Err() != nil {
				endErr = ctx.Err()
				return ctx.Err()
			}
			cause := context.Cause(sctx)
			log.Info("agent stream closed by broker", "reason", cause.Error())
			endErr = cause
			return errdefs.ToStatus(cause).Err()
		}
	}
}

// auditAgent writes one audit line of an agent stream: msg is "agent
// connected", "agent disconnected" or "agent refused"; err, nil when all
// went well, gives the code and the reason.
func (s *Server) auditAgent(msg, spiffeID, instance, cluster string, err error, kv ...any) {
	line := []any{"spiffeID", spiffeID, "instance", instance, "cluster", cluster, "code", errdefs.Code(err).String()}
	if err != nil {
		line = append(line, "reason", err.Error())
	}
	s.cfg.Audit.Info(msg, append(line, kv...)...)
}

// verify checks chain against the current trust bundle at the clock's
// present, and returns the earliest NotAfter of the verified chain, the end
// of the agent's identity. Errors wrap errdefs.ErrUnauthenticated.
func (s *Server) verify(id spiffeid.ID, chain []*x509.Certificate) (time.Time, error) {
	if len(chain) == 0 {
		return time.Time{}, fmt.Errorf("agent %s presented no certificate: %w", id, errdefs.ErrUnauthenticated)
	}
	_, verified, err := x509svid.Verify(chain, s.cfg.Bundles, x509svid.WithTime(s.cfg.Clock.Now()))
	if err != nil {
		return time.Time{}, fmt.Errorf("agent %s: its SVID does not verify against the current trust bundle (%v); "+
			"the agent must reconnect with a current one: %w", id, err, errdefs.ErrUnauthenticated)
	}
	expires := chain[0].NotAfter
	for _, c := range verified[0] {
		if c.NotAfter.Before(expires) {
			expires = c.NotAfter
		}
	}
	return expires, nil
}

func recvHello(ctx context.Context, stream grpc.BidiStreamingServer[pb.AgentFrame, pb.BrokerFrame], timeout time.Duration) (*pb.Hello, error) {
	type result struct {
		f   *pb.AgentFrame
		err error
	}
	ch := make(chan result, 1)
	go func() {
		f, err := stream.Recv()
		ch <- result{f, err}
	}()
	select {
	case r := <-ch:
		if r.err != nil {
			return nil, r.err
		}
		if r.f.GetHello() == nil {
			return nil, fmt.Errorf("agent stream: the first frame must be a hello: %w", errdefs.ErrInvalidArgument)
		}
		return r.f.GetHello(), nil
	case <-time.After(timeout):
		return nil, fmt.Errorf("agent stream: no hello within %s: %w", timeout, errdefs.ErrDeadlineExceeded)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// sessionsChanged calls OnSessionsChange, if set.
func (s *Server) sessionsChanged(key types.NamespacedName) {
	if s.cfg.OnSessionsChange != nil {
		s.cfg.OnSessionsChange(key)
	}
}

// receive delivers answers to their waiting requests, grant updates to
// grants and spoke health reports to the session (then calls
// healthChanged), until the stream ends or the agent sends a frame the
// broker does not take (an error wrapping errAgentFrame).
func (sess *session) receive(stream grpc.BidiStreamingServer[pb.AgentFrame, pb.BrokerFrame], grants GrantRegistry,
	healthChanged func(types.NamespacedName), log logr.Logger) error {
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
			log.Info("agent is leaving; no new request goes down its stream")
			continue
		}
		sess.mu.Lock()
		ch, ok := sess.pending[f.GetCorrelationId()]
		delete(sess.pending, f.GetCorrelationId())
		sess.mu.Unlock()
		if !ok {
			// A late answer to a request that timed out, or a stray frame.
			log.V(1).Info("agent frame matches no request", "correlationID", clipAgentString(f.GetCorrelationId(), maxLoggedCorrelationID))
			continue
		}
		ch <- f // buffered; never blocks
	}
}

// The longest agent version and correlation id the broker logs, in bytes,
// before the "..." that marks a clipped one: an agent chooses them, and
// the log is not its to fill.
const (
	maxAgentVersion        = 128
	maxLoggedCorrelationID = 64
)

// agentVersion is the version an agent's hello names, fit to log: as
// agentMessage makes it, and clipped to maxAgentVersion bytes.
func agentVersion(v string) string { return clipAgentString(v, maxAgentVersion) }

// clipAgentString makes s, which an agent sent, fit to log: as
// agentMessage makes it, and clipped to at most n bytes and "...".
func clipAgentString(s string, n int) string {
	s = agentMessage(s)
	if len(s) <= n {
		return s
	}
	// s is valid UTF-8, so s[0] starts a rune and the loop ends.
	cut := n
	for !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "..."
}

// errAgentFrame marks a frame that makes the broker close the stream.
var errAgentFrame = errors.New("agent stream: the agent sent")

func (s *Server) add(sess *session) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	key := sess.cluster.NamespacedName
	if s.draining {
		return errDraining
	}
	if n := len(s.sessions[key]); n >= s.cfg.MaxStreamsPerCluster {
		return fmt.Errorf("cluster %s already has %d agent streams to this broker: %w", sess.cluster, n, errdefs.ErrResourceExhausted)
	}
	s.sessions[key] = append(s.sessions[key], sess)
	return nil
}

func (s *Server) remove(sess *session) {
	s.mu.Lock()
	defer s.mu.Unlock()
	key := sess.cluster.NamespacedName
	list := s.sessions[key]
	for i, x := range list {
		if x == sess {
			list = append(list[:i:i], list[i+1:]...)
			break
		}
	}
	if len(list) == 0 {
		delete(s.sessions, key)
	} else {
		s.sessions[key] = list
	}
}

// live returns the sessions that serve cluster and take new requests: open,
// whose agent has not said goodbye, and of those of one agent instance, the
// newest.
func (s *Server) live(cluster fleet.ClusterRef) []*session {
	s.mu.RLock()
	defer s.mu.RUnlock()
	list := s.sessions[cluster.NamespacedName]
	var out []*session
	newest := map[agentInstance]bool{}
	for i := len(list) - 1; i >= 0; i-- { // newest first
		sess := list[i]
		if sess.cluster.UID != cluster.UID || sess.ctx.Err() != nil || sess.isLeaving() {
			continue
		}
		if sess.instance != "" {
			key := agentInstance{sess.agent, sess.instance}
			if newest[key] {
				continue // draining: a newer stream of the agent takes its requests
			}
			newest[key] = true
		}
		out = append(out, sess)
	}
	slices.Reverse(out)
	return out
}

// agentInstance names one agent's Client: its SPIFFE ID and instanceHeader.
type agentInstance struct {
	id       spiffeid.ID
	instance string
}

// instanceOf returns the instanceHeader of an agent's stream, if it sent a
// usable one.
func instanceOf(ctx context.Context) string {
	md, _ := metadata.FromIncomingContext(ctx)
	v := md.Get(instanceHeader)
	if len(v) != 1 || len(v[0]) == 0 || len(v[0]) > 64 {
		return ""
	}
	return v[0]
}

// Pending reports how many mints and revokes wait for an agent's answer.
func (s *Server) Pending() int { return int(s.pending.Load()) }

// Connected reports how many live sessions serve cluster.
func (s *Server) Connected(cluster fleet.ClusterRef) int { return len(s.live(cluster)) }

// ConnectedClusters reports how many clusters have at least one open
// session whose agent has not said goodbye.
func (s *Server) ConnectedClusters() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	n := 0
	for _, list := range s.sessions {
		if slices.ContainsFunc(list, func(sess *session) bool { return sess.ctx.Err() == nil && !sess.isLeaving() }) {
			n++
		}
	}
	return n
}

// DataPathOffer is one way to verify a spoke API server that live sessions
// of a cluster offered in their hellos for the data path, and how many did.
type DataPathOffer struct {
	ServerName string
	CAData     []byte
	Streams    int
}

// DataPaths returns every distinct data path offer of the live sessions of
// cluster, oldest first. Like Advertised, it picks none.
func (s *Server) DataPaths(cluster fleet.ClusterRef) (offers []DataPathOffer) {
	list := s.live(cluster)
	for _, sess := range list {
		dp := sess.hello.GetDataPath()
		if dp == nil {
			continue
		}
		i := slices.IndexFunc(offers, func(o DataPathOffer) bool {
			return o.ServerName == dp.GetServerName() && bytes.Equal(o.CAData, dp.GetCertificateAuthorityData())
		})
		if i < 0 {
			offers = append(offers, DataPathOffer{ServerName: dp.GetServerName(), CAData: dp.GetCertificateAuthorityData()})
			i = len(offers) - 1
		}
		offers[i].Streams++
	}
	return offers
}

// Advertisement is one spoke API server URL and CA that live sessions of a
// cluster advertised in their hellos, and how many did.
type Advertisement struct {
	Server  string
	CAData  []byte
	Streams int
}

// Advertised returns every distinct server and CA that the live sessions of
// cluster advertised in their hellos, oldest advertiser first, with the
// number of live sessions (those that advertised nothing included). It
// picks none: which one, if any, is published is the publisher's decision,
// so that no agent decides it by connecting last.
func (s *Server) Advertised(cluster fleet.ClusterRef) (ads []Advertisement, live int) {
	list := s.live(cluster)
	for _, sess := range list {
		h := sess.hello
		if h.GetServer() == "" {
			continue
		}
		i := slices.IndexFunc(ads, func(a Advertisement) bool {
			return a.Server == h.GetServer() && bytes.Equal(a.CAData, h.GetCertificateAuthorityData())
		})
		if i < 0 {
			ads = append(ads, Advertisement{Server: h.GetServer(), CAData: h.GetCertificateAuthorityData()})
			i = len(ads) - 1
		}
		ads[i].Streams++
	}
	return ads, len(list)
}

// SpokeReadiness counts the live sessions of a cluster by what their
// agents last reported of the spoke API server's /readyz.
type SpokeReadiness struct {
	// Ready and NotReady count the sessions whose agents reported the
	// spoke ready, and not ready; the others reported nothing.
	Ready, NotReady int
	// Message is the message of the oldest not ready report.
	Message string
}

// SpokeReadiness counts the live sessions of cluster by what their agents
// last reported of the spoke's /readyz.
func (s *Server) SpokeReadiness(cluster fleet.ClusterRef) SpokeReadiness {
	var out SpokeReadiness
	for _, sess := range s.live(cluster) {
		switch h := sess.spokeHealth.Load(); {
		case h == nil:
		case h.GetReady():
			out.Ready++
		default:
			if out.NotReady == 0 {
				out.Message = h.GetMessage()
			}
			out.NotReady++
		}
	}
	return out
}

// Revalidate re-resolves the agent of every session of the named cluster and
// closes those that no longer map to the ClusterProfile they were admitted
// for: it was deleted, recreated, or its agent ID annotation changed. The
// broker calls it whenever a ClusterProfile changes.
func (s *Server) Revalidate(key types.NamespacedName) {
	s.mu.RLock()
	list := append([]*session(nil), s.sessions[key]...)
	s.mu.RUnlock()
	for _, sess := range list {
		s.revalidate(sess)
	}
}

// revalidate closes sess unless its agent still maps to the ClusterProfile
// incarnation it was admitted for.
func (s *Server) revalidate(sess *session) {
	if err := s.stillServes(sess.agent, sess.cluster); err != nil {
		sess.cancel(err)
	}
}

// stillServes reports why agent no longer maps to the ClusterProfile
// incarnation cluster, or nil.
func (s *Server) stillServes(agent spiffeid.ID, cluster fleet.ClusterRef) error {
	got, err := s.cfg.Resolver.ResolveAgent(agent)
	switch {
	case err != nil:
		return fmt.Errorf("agent %s no longer serves %s: %w", agent, cluster, err)
	case got != cluster:
		return fmt.Errorf("agent %s no longer serves %s: the ClusterProfile changed: %w", agent, cluster, errdefs.ErrPermissionDenied)
	}
	return nil
}

// Reverify checks the SVID of every live stream against the current trust
// bundle, and closes the streams whose SVID no longer verifies: its CA left
// the bundle, or it expired. The broker calls it whenever its trust bundle
// may have changed.
func (s *Server) Reverify() {
	s.mu.RLock()
	var all []*session
	for _, list := range s.sessions {
		all = append(all, list...)
	}
	s.mu.RUnlock()
	for _, sess := range all {
		if _, err := s.verify(sess.agent, sess.chain); err != nil {
			sess.cancel(err)
		}
	}
}

// Mint sends req to one live agent session of cluster and returns its answer.
// Errors wrap errdefs sentinels: ErrUnavailable when no agent is connected or
// the stream breaks, ErrDeadlineExceeded when the agent does not answer within
// MintTimeout, and the agent's own code when it refuses.
func (s *Server) Mint(ctx context.Context, cluster fleet.ClusterRef, req *pb.MintRequest) (*pb.MintResponse, error) {
	return call(s, ctx, cluster, &pb.BrokerFrame{Body: &pb.BrokerFrame_MintRequest{MintRequest: req}}, answerOf, s.metrics.observeMint)
}

// Revoke asks every live agent instance of cluster to delete the grants of
// ids, and returns the ids whose grants are gone: those that every
// instance answered gone, of the ids asked. Whoever holds a cluster's SVID
// may connect beside its honest agents and answer every revoke "gone", so
// no one instance's answer is believed: the revoke reaches every agent
// that may hold the grant, and an id that any instance still holds, or
// that an instance did not answer for (an error, its stream closed, or no
// answer within MintTimeout), is not gone, and the caller sends it again.
// Long lists go in several requests to each instance, each bounded by
// MintTimeout; an instance that fails one is sent no more of them. Errors
// wrap errdefs sentinels as Mint's do: ErrUnavailable when no agent is
// connected, and otherwise the first instance's failure, with the ids gone
// in every instance's answer; fleet.ErrNoAgent too when no agent stream
// of cluster was open, so that nothing was sent. It implements
// grants.Revoker.
func (s *Server) Revoke(ctx context.Context, cluster fleet.ClusterRef, ids []string, reason string) ([]string, error) {
	list := batches(ids, maxRevokeIDs, maxRevokeBytes)
	if len(list) == 0 {
		return nil, nil
	}
	targets := s.revokeTargets(cluster)
	if len(targets) == 0 {
		return nil, fmt.Errorf("%w for cluster %s: %w", fleet.ErrNoAgent, cluster, errdefs.ErrUnavailable)
	}
	isTarget := make(map[*session]bool, len(targets))
	for _, sess := range targets {
		isTarget[sess] = true
	}
	votes := make([]revokeVote, len(targets))
	var wg sync.WaitGroup
	for i, sess := range targets {
		wg.Go(func() { votes[i] = s.revokeOn(ctx, cluster, sess, isTarget, list, reason) })
	}
	wg.Wait()

	var (
		gone     []string
		err      error
		disagree int // ids some instances answered gone and others not
		voters   int
	)
	for _, v := range votes {
		if !v.replaced {
			voters++
		}
	}
	for b, batch := range list {
		count := make(map[string]int, len(batch))
		answered := true
		for _, v := range votes {
			switch {
			case v.replaced:
				continue
			case b >= len(v.gone):
				answered = false
				if err == nil {
					err = v.err
				}
				continue
			}
			for _, id := range v.gone[b] {
				count[id]++
			}
		}
		for _, id := range batch {
			switch {
			case answered && voters > 0 && count[id] == voters:
				gone = append(gone, id)
			case count[id] > 0:
				disagree++
			}
		}
	}
	if disagree > 0 {
		s.cfg.Log.Info("agents of one cluster disagree on a revoke; the ids stay pending",
			"cluster", cluster.String(), "instances", voters, "pending", disagree)
	}
	if err != nil {
		return gone, fmt.Errorf("cluster %s: %w", cluster, err)
	}
	return gone, nil
}

// revokeVote is one agent instance's answer to a revoke: the ids it
// answered gone, per batch, up to the first batch it failed, and that
// failure. An instance whose stream closed while another stream of it
// took the same requests is replaced: that stream answers for it.
type revokeVote struct {
	gone     [][]string
	err      error
	replaced bool
}

// revokeTargets returns the streams a revoke of cluster goes to: every
// open stream that has not said goodbye, of every agent instance, the
// draining streams of an instance included (another holder of the
// instance's SPIFFE ID may have named itself with its instance value).
func (s *Server) revokeTargets(cluster fleet.ClusterRef) []*session {
	s.mu.RLock()
	defer s.mu.RUnlock()
	var out []*session
	for _, sess := range s.sessions[cluster.NamespacedName] {
		if sess.cluster.UID == cluster.UID && sess.ctx.Err() == nil && !sess.isLeaving() {
			out = append(out, sess)
		}
	}
	return out
}

// revokeOn sends the batches of list to sess, one request at a time, and
// returns its vote. A stream that closes under a request hands the rest to
// the newest stream of the same agent instance, unless that stream is one
// of targets, which is asked on its own.
func (s *Server) revokeOn(ctx context.Context, cluster fleet.ClusterRef, sess *session, targets map[*session]bool,
	list [][]string, reason string) revokeVote {
	var v revokeVote
	for _, batch := range list {
		req := &pb.BrokerFrame{Body: &pb.BrokerFrame_RevokeRequest{RevokeRequest: &pb.RevokeRequest{CredentialIds: batch, Reason: reason}}}
		var (
			f   *pb.AgentFrame
			err error
		)
		start := time.Now()
		for {
			f, err = s.requestOne(ctx, sess, req)
			if !errors.Is(err, errStreamClosed) {
				break
			}
			next := s.successor(cluster, sess)
			if next == nil {
				break
			}
			if targets[next] {
				s.metrics.observeRevoke(start, err)
				return revokeVote{replaced: true}
			}
			sess = next
		}
		var got []string
		if err == nil {
			var foreign int
			got, foreign, err = revokeAnswerOf(f, batch)
			if foreign > 0 {
				s.cfg.Log.Info("agent answered a revoke with credential ids it was not asked about; ignored them",
					"cluster", cluster.String(), "ignored", foreign)
			}
		}
		s.metrics.observeRevoke(start, err)
		if err != nil {
			v.err = err
			return v
		}
		v.gone = append(v.gone, got)
	}
	return v
}

// requestOne sends req down sess and waits for its answer, within
// MintTimeout.
func (s *Server) requestOne(ctx context.Context, sess *session, req *pb.BrokerFrame) (*pb.AgentFrame, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.MintTimeout)
	defer cancel()
	s.pending.Add(1)
	defer s.pending.Add(-1)
	return sess.request(ctx, req)
}

// successor returns the live stream that took over the requests of sess,
// closed: the newest of the same agent SPIFFE ID and instance, if any.
func (s *Server) successor(cluster fleet.ClusterRef, sess *session) *session {
	if sess.instance == "" {
		return nil
	}
	for _, next := range s.live(cluster) {
		if next != sess && next.agent == sess.agent && next.instance == sess.instance {
			return next
		}
	}
	return nil
}

// A revoke request carries at most maxRevokeIDs credential ids, of at most
// maxRevokeBytes together, so that the agent's answer, which repeats them,
// stays well under the broker's 64 KiB message limit, and so that the
// agent, which deletes one grant per id, answers well within MintTimeout.
const (
	maxRevokeIDs   = 64
	maxRevokeBytes = 16 << 10
)

// batches returns the distinct non-empty ids in order, in batches of at most
// n ids and, unless one id alone is longer, of at most size bytes.
func batches(ids []string, n, size int) [][]string {
	var (
		out   [][]string
		cur   []string
		bytes int
		seen  = map[string]bool{}
	)
	for _, id := range ids {
		if id == "" || seen[id] {
			continue
		}
		seen[id] = true
		if len(cur) > 0 && (len(cur) == n || bytes+len(id) > size) {
			out, cur, bytes = append(out, cur), nil, 0
		}
		cur, bytes = append(cur, id), bytes+len(id)
	}
	if len(cur) > 0 {
		out = append(out, cur)
	}
	return out
}

// call sends req down one live session of cluster, round robin, and reads
// the answer with answer. A stream that closes under the request hands it
// to another live one, of those live then. The whole call is bounded by MintTimeout. observe sees
// every call that found a session.
func call[T any](s *Server, ctx context.Context, cluster fleet.ClusterRef, req *pb.BrokerFrame,
	answer func(*pb.AgentFrame) (T, error), observe func(time.Time, error)) (T, error) {
	var zero T
	sessions := s.live(cluster)
	if len(sessions) == 0 {
		return zero, fmt.Errorf("no agent is connected for cluster %s: %w", cluster, errdefs.ErrUnavailable)
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.MintTimeout)
	defer cancel()
	s.pending.Add(1)
	defer s.pending.Add(-1)
	start := time.Now()
	var (
		f   *pb.AgentFrame
		err error
	)
	first := s.next.Add(1)
	tried := map[*session]bool{}
	for {
		var sess *session
		for i := range uint64(len(sessions)) {
			if c := sessions[(first+i)%uint64(len(sessions))]; !tried[c] {
				sess = c
				break
			}
		}
		if sess == nil {
			break // err is the last stream's errStreamClosed
		}
		tried[sess] = true
		f, err = sess.request(ctx, req)
		if !errors.Is(err, errStreamClosed) {
			break
		}
		// The sessions of the cluster now, which may include a stream
		// opened since, such as the one that replaced a drained stream.
		sessions = s.live(cluster)
	}
	var v T
	if err == nil {
		v, err = answer(f)
	}
	observe(start, err)
	if err != nil {
		return v, fmt.Errorf("cluster %s: %w", cluster, err)
	}
	return v, nil
}

// request sends the body of req down the stream under a new correlation id,
// and returns the agent's answer.
func (sess *session) request(ctx context.Context, req *pb.BrokerFrame) (*pb.AgentFrame, error) {
	id := newCorrelationID()
	answer := make(chan *pb.AgentFrame, 1)
	sess.mu.Lock()
	sess.pending[id] = answer
	sess.mu.Unlock()
	defer func() {
		sess.mu.Lock()
		delete(sess.pending, id)
		sess.mu.Unlock()
	}()

	frame := &pb.BrokerFrame{CorrelationId: id, Body: req.GetBody()}
	select {
	case sess.out <- frame:
	case <-sess.ctx.Done():
		return nil, fmt.Errorf("%w: %w", errStreamClosed, errdefs.ErrUnavailable)
	case <-ctx.Done():
		return nil, waitErr(ctx)
	}

	select {
	case f := <-answer:
		return f, nil
	case <-sess.ctx.Done():
		return nil, fmt.Errorf("%w before it answered: %w", errStreamClosed, errdefs.ErrUnavailable)
	case <-ctx.Done():
		return nil, waitErr(ctx)
	}
}

// errStreamClosed marks a request whose stream ended under it; another
// stream of the cluster may still serve it.
var errStreamClosed = errors.New("agent stream closed")

func waitErr(ctx context.Context) error {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return fmt.Errorf("the agent did not answer in time: %w", errdefs.ErrDeadlineExceeded)
	}
	return ctx.Err()
}

// answerOf reads an agent's answer. An answer that is not a well-formed
// token is the agent's failure, so the consumer sees Unavailable, as for
// any answer that fails the exchange's checks.
func answerOf(f *pb.AgentFrame) (*pb.MintResponse, error) {
	switch body := f.GetBody().(type) {
	case *pb.AgentFrame_MintResponse:
		r := body.MintResponse
		if r.GetToken() == "" || r.GetExpirationTime() == nil {
			return nil, fmt.Errorf("the agent answered without a token or an expiry: %w", errdefs.ErrUnavailable)
		}
		if err := token.CheckShape(r.GetToken()); err != nil {
			return nil, fmt.Errorf("the agent answered with a malformed token: %w: %w", err, errdefs.ErrUnavailable)
		}
		return r, nil
	case *pb.AgentFrame_Error:
		return nil, agentError(body.Error)
	default:
		return nil, fmt.Errorf("the agent answered with an unexpected frame %T: %w", body, errdefs.ErrUnavailable)
	}
}

// revokeAnswerOf reads an agent's answer to a revoke of asked: the ids it
// says are gone, of those asked, once each, and how many others it named.
// The agent may be compromised; ids it was not asked about are not its to
// report gone.
func revokeAnswerOf(f *pb.AgentFrame, asked []string) (gone []string, foreign int, err error) {
	switch body := f.GetBody().(type) {
	case *pb.AgentFrame_RevokeResponse:
		want := make(map[string]bool, len(asked))
		for _, id := range asked {
			want[id] = true
		}
		for _, id := range body.RevokeResponse.GetCredentialIds() {
			if !want[id] {
				foreign++
				continue
			}
			want[id] = false // once
			gone = append(gone, id)
		}
		return gone, foreign, nil
	case *pb.AgentFrame_Error:
		return nil, 0, agentError(body.Error)
	default:
		return nil, 0, fmt.Errorf("the agent answered a revoke with an unexpected frame %T: %w", body, errdefs.ErrUnavailable)
	}
}

// agentError reads an agent's refusal. Its code is kept only if it is one
// an agent may give, and its message is made fit to show a consumer.
func agentError(e *pb.Error) error {
	code := codes.Code(e.GetCode())
	if !slices.Contains(agentCodes, code) {
		// Other codes describe the consumer's own call (its hub token,
		// its rate) and are not the agent's to give.
		code = codes.Unavailable
	}
	return errdefs.FromCode(code, "agent: "+agentMessage(e.GetMessage()))
}

// agentCodes are the codes an agent may answer with.
var agentCodes = []codes.Code{
	codes.PermissionDenied, codes.NotFound, codes.InvalidArgument, codes.FailedPrecondition,
	codes.Unavailable, codes.DeadlineExceeded, codes.Canceled, codes.Internal,
}

func newCorrelationID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	if st, ok := status.FromError(err); ok {
		return st.Code().String() + ": " + st.Message()
	}
	return err.Error()
}
