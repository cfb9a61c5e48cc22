package tunnel

import (
	"context"
	"crypto/x509"
	"fmt"
	"time"

	"github.com/go-logr/logr"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"k8s.io/apimachinery/pkg/types"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// Admit judges the peer of a stream whose context is ctx, as Connect does:
// its SVID must verify against the current trust bundle, by the clock of
// now (a connection outlives the handshake that verified it), and map to a
// ClusterProfile. Another stream service on the agent port, such as the
// data path, admits its streams with it, logs and audits nothing else, and
// calls Readmit while the stream lives.
func (s *Server) Admit(ctx context.Context) (fleet.Admission, error) {
	id, chain, err := s.cfg.Peer(ctx)
	if err != nil {
		return fleet.Admission{}, fmt.Errorf("agent stream: %w", err)
	}
	adm := fleet.Admission{Agent: id, Chain: chain}
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
func (s *Server) Readmit(adm fleet.Admission) error {
	if _, err := s.verify(adm.Agent, adm.Chain); err != nil {
		return err
	}
	return s.stillServes(adm.Agent, adm.Cluster)
}

// admit is Connect's first step: it judges the stream's peer (Admit),
// reads its hello within HelloTimeout, and registers the session, which
// takes requests from then on; it returns the session and when the agent's
// identity ends. A stream it does not admit is refused (refuse), and the
// error is the status that ends it.
func (s *Server) admit(stream grpc.BidiStreamingServer[pb.AgentFrame, pb.BrokerFrame]) (*session, time.Time, error) {
	ctx := stream.Context()
	instance := instanceOf(ctx)
	adm, err := s.Admit(ctx)
	if err != nil {
		log := logr.Discard() // a peer without a SPIFFE ID is only audited
		if !adm.Agent.IsZero() {
			log = s.cfg.Log.WithValues(fleet.LogAgent, adm.Agent.String())
		}
		return nil, time.Time{}, s.refuse(log, "agent refused", agentStream{adm.Agent.String(), instance, ""}, err)
	}
	log := s.cfg.Log.WithValues(fleet.LogAgent, adm.Agent.String(), fleet.LogCluster, adm.Cluster.String())
	who := agentStream{adm.Agent.String(), instance, adm.Cluster.String()}
	hello, err := s.recvHello(ctx, stream)
	if err != nil {
		return nil, time.Time{}, s.refuse(log, "agent stream closed before hello", who, err)
	}
	if n := len(hello.GetGrants()); n > MaxGrantsPerFrame {
		return nil, time.Time{}, s.refuse(log, "agent refused", who, fmt.Errorf(
			"agent stream: the hello carries %d grants, more than %d; send the rest as grant updates: %w", n, MaxGrantsPerFrame, errdefs.ErrInvalidArgument))
	}
	sctx, cancel := context.WithCancelCause(ctx)
	sess := &session{
		agent: adm.Agent, instance: instance, chain: adm.Chain, cluster: adm.Cluster, hello: hello, log: log,
		out: make(chan *pb.BrokerFrame, 16), ctx: sctx, cancel: cancel,
		pending: map[string]chan *pb.AgentFrame{},
	}
	sess.setSpokeHealth(hello.GetSpokeHealth())
	// The session counts against the cluster's streams from here on, and
	// takes requests once Connect's checks pass (startServing).
	if err := s.add(sess); err != nil {
		cancel(nil)
		return nil, time.Time{}, s.refuse(log, "agent refused", who, err)
	}
	return sess, adm.Expires, nil
}

// refuse ends a stream that Connect does not serve: it logs msg and the
// reason on log, audits "agent refused" for who, and returns the status.
func (s *Server) refuse(log logr.Logger, msg string, who agentStream, err error) error {
	log.Info(msg, fleet.LogErr, err.Error())
	s.auditAgent("agent refused", who, err)
	return errdefs.ToStatus(err).Err()
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

// recvHello reads the agent's first frame, which must be a hello, within
// HelloTimeout by the Server's clock.
func (s *Server) recvHello(ctx context.Context, stream grpc.BidiStreamingServer[pb.AgentFrame, pb.BrokerFrame]) (*pb.Hello, error) {
	type result struct {
		f   *pb.AgentFrame
		err error
	}
	ch := make(chan result, 1)
	go func() {
		f, err := stream.Recv()
		ch <- result{f, err}
	}()
	timeout := s.cfg.Clock.NewTimer(s.cfg.HelloTimeout)
	defer timeout.Stop()
	select {
	case r := <-ch:
		if r.err != nil {
			return nil, r.err
		}
		if r.f.GetHello() == nil {
			return nil, fmt.Errorf("agent stream: the first frame must be a hello: %w", errdefs.ErrInvalidArgument)
		}
		return r.f.GetHello(), nil
	case <-timeout.C():
		return nil, fmt.Errorf("agent stream: no hello within %s: %w", s.cfg.HelloTimeout, errdefs.ErrDeadlineExceeded)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// maxInstance bounds an instanceHeader.
const maxInstance = 64

// instanceOf returns the instanceHeader of an agent's stream, if it sent a
// usable one.
func instanceOf(ctx context.Context) string {
	md, _ := metadata.FromIncomingContext(ctx)
	v := md.Get(instanceHeader)
	if len(v) != 1 || len(v[0]) == 0 || len(v[0]) > maxInstance {
		return ""
	}
	return v[0]
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
