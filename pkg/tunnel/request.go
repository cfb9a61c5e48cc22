package tunnel

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// Mint sends req to the live agent session of cluster that req's mint key
// picks (mintKey), and returns its answer. Errors wrap errdefs sentinels:
// ErrUnavailable when no agent is connected or the stream breaks,
// ErrDeadlineExceeded when the agent does not answer within MintTimeout, and
// the agent's own code when it refuses.
func (s *Server) Mint(ctx context.Context, cluster fleet.ClusterRef, req *pb.MintRequest) (*pb.MintResponse, error) {
	return call(s, ctx, cluster, mintKey(req), &pb.BrokerFrame{Body: &pb.BrokerFrame_MintRequest{MintRequest: req}}, answerOf, s.metrics.observeMint)
}

// mintKey is what picks the agent a mint goes to: the namespace of the
// ServiceAccount req names or, when it names none and the agent picks one,
// req's subject. An agent keeps pooled grants (pkg/spoke) in the
// namespaces it mints in, and they count against the namespace's Secret
// quota: sending a namespace's mints to one agent keeps the pooled grants
// of one agent there, not of every agent of the spoke.
func mintKey(req *pb.MintRequest) string {
	if ns := req.GetServiceAccount().GetNamespace(); ns != "" {
		return "namespace\x00" + ns
	}
	return "subject\x00" + req.GetSubject().GetUsername()
}

// call sends req down the live session of cluster that key picks (pick),
// and reads the answer with answer. A stream that closes under the request
// hands it to the next one key picks, of those live then. The whole call is
// bounded by MintTimeout. observe sees every call that found a session.
func call[T any](s *Server, ctx context.Context, cluster fleet.ClusterRef, key string, req *pb.BrokerFrame,
	answer func(*pb.AgentFrame) (T, error), observe func(time.Time, error)) (T, error) {
	var zero T
	ctx, cancel := context.WithTimeout(ctx, s.cfg.MintTimeout)
	defer cancel()
	sessions := s.live(cluster)
	if len(sessions) == 0 {
		sessions = s.awaitReturn(ctx, cluster)
	}
	if len(sessions) == 0 {
		return zero, fmt.Errorf("no agent is connected for cluster %s: %w", cluster, errdefs.ErrUnavailable)
	}
	s.pending.Add(1)
	defer s.pending.Add(-1)
	start := time.Now()
	var (
		f   *pb.AgentFrame
		err error
	)
	tried := map[*session]bool{}
	for {
		sess := pick(sessions, key, tried)
		if sess == nil {
			break // err is the last stream's errStreamClosed
		}
		tried[sess] = true
		f, err = sess.request(ctx, req)
		if !errors.Is(err, errStreamClosed) {
			break
		}
		// The sessions of the cluster now, which may include a stream
		// opened since, such as the one that replaced a drained stream,
		// or the agent's next stream, when this one was its last.
		if sessions = s.live(cluster); len(sessions) == 0 {
			sessions = s.awaitReturn(ctx, cluster)
		}
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

// pick returns the session, of those not tried, that ranks first for key
// by rendezvous hashing over the agent instances (SPIFFE ID and
// instanceHeader). Every broker replica that sees the same agents picks the
// same one, a stream that replaces another of its instance keeps its keys,
// and a key moves only when its agent goes. Sessions of equal rank (agents
// that send no instance) go in the order given. nil when every session was
// tried.
func pick(sessions []*session, key string, tried map[*session]bool) *session {
	var (
		best *session
		top  uint64
	)
	for _, sess := range sessions {
		if tried[sess] {
			continue
		}
		if w := rank(key, sess.agent, sess.instance); best == nil || w > top {
			best, top = sess, w
		}
	}
	return best
}

// rank is the rendezvous weight of an agent instance for key.
func rank(key string, agent spiffeid.ID, instance string) uint64 {
	h := sha256.New()
	for _, s := range []string{key, agent.String(), instance} {
		_, _ = io.WriteString(h, s)
		_, _ = h.Write([]byte{0})
	}
	return binary.BigEndian.Uint64(h.Sum(nil))
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

// requestOne sends req down sess and waits for its answer, within
// MintTimeout.
func (s *Server) requestOne(ctx context.Context, sess *session, req *pb.BrokerFrame) (*pb.AgentFrame, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.MintTimeout)
	defer cancel()
	s.pending.Add(1)
	defer s.pending.Add(-1)
	return sess.request(ctx, req)
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

func newCorrelationID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
