package tunnel

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

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
			fleet.LogCluster, cluster.String(), "instances", voters, "pending", disagree)
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
// open stream (isOpen) of every agent instance, the draining streams of an
// instance included (another holder of the instance's SPIFFE ID may have
// named itself with its instance value).
func (s *Server) revokeTargets(cluster fleet.ClusterRef) []*session {
	s.mu.RLock()
	defer s.mu.RUnlock()
	var out []*session
	for _, sess := range s.sessions[cluster.NamespacedName] {
		if sess.cluster.UID == cluster.UID && sess.isOpen() {
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
					fleet.LogCluster, cluster.String(), fleet.LogIgnored, foreign)
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
