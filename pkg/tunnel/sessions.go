package tunnel

import (
	"bytes"
	"context"
	"crypto/x509"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"k8s.io/apimachinery/pkg/types"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// session is one live Connect stream.
type session struct {
	agent    spiffeid.ID
	instance string              // the agent's instanceHeader; empty when it sent none
	chain    []*x509.Certificate // the agent's SVID, leaf first
	hello    *pb.Hello           // server and CA the agent advertised
	cluster  fleet.ClusterRef
	log      logr.Logger // carries the agent and the cluster
	out      chan *pb.BrokerFrame
	ctx      context.Context
	cancel   context.CancelCauseFunc

	mu      sync.Mutex
	pending map[string]chan *pb.AgentFrame

	// serving is set once Connect's checks of the admitted stream passed
	// (startServing): only then does it take requests or count as the
	// cluster's agent.
	serving atomic.Bool
	// leaving is set when the agent says goodbye: no new request goes down
	// the stream, and the agent closes it once it has answered those in
	// flight.
	leaving atomic.Bool
	// spokeHealth is the agent's last report of its spoke's /readyz, its
	// message clipped; nil when it reported none.
	spokeHealth atomic.Pointer[pb.SpokeHealth]
}

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

// startServing makes sess, admitted by add, take requests once Connect's
// checks passed: from now on live counts it, and the mints waiting for its
// cluster's agent to return wake. It reports false, and changes nothing,
// when sess was closed meanwhile. Until then sess takes no request, so an
// agent refused by those checks is never sent one.
func (s *Server) startServing(sess *session) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if sess.ctx.Err() != nil {
		return false
	}
	sess.serving.Store(true)
	key := sess.cluster.NamespacedName
	delete(s.gone, key)
	if ch, ok := s.arrived[key]; ok {
		close(ch)
		delete(s.arrived, key)
	}
	return true
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
	if len(list) > 0 {
		s.sessions[key] = list
		return
	}
	delete(s.sessions, key)
	if s.cfg.ReturnWait > 0 && sess.serving.Load() {
		now := s.cfg.Clock.Now()
		s.forgetGone(now)
		s.gone[key] = now
		s.goneOrder = append(s.goneOrder, goneAt{key, now})
	}
}

// goneAt is when the last stream of a cluster ended.
type goneAt struct {
	key types.NamespacedName
	at  time.Time
}

// forgetGone drops what gone and arrived hold of the clusters whose last
// stream ended ReturnWait or more before now, oldest first, so that they
// hold no more than the clusters gone within ReturnWait; s.mu is held.
func (s *Server) forgetGone(now time.Time) {
	for len(s.goneOrder) > 0 && now.Sub(s.goneOrder[0].at) >= s.cfg.ReturnWait {
		g := s.goneOrder[0]
		s.goneOrder = s.goneOrder[1:]
		if at, ok := s.gone[g.key]; ok && at.Equal(g.at) {
			delete(s.gone, g.key)
			delete(s.arrived, g.key) // its waiters' timers have fired
		}
	}
}

// awaitReturn waits, until ctx ends or for ReturnWait after the last stream
// of cluster ended, for a live stream of it, and returns the live sessions
// then; none when the cluster's last stream ended longer ago, or never was.
// A cluster whose last streams of this incarnation are closing (not yet
// removed) counts as just gone; one whose agents said goodbye does not: an
// agent that leaves opens its next stream first. A draining Server waits
// for none, and its Drain ends the waits: its agents are leaving for
// another replica.
func (s *Server) awaitReturn(ctx context.Context, cluster fleet.ClusterRef) []*session {
	if s.cfg.ReturnWait <= 0 {
		return nil
	}
	key := cluster.NamespacedName
	s.mu.RLock()
	now := s.cfg.Clock.Now()
	ended, ok := s.gone[key]
	if !ok && slices.ContainsFunc(s.sessions[key], func(sess *session) bool {
		return sess.cluster.UID == cluster.UID && sess.serving.Load() && sess.ctx.Err() != nil && !sess.isLeaving()
	}) {
		ended, ok = now, true
	}
	draining := s.draining
	s.mu.RUnlock()
	if draining || !ok || now.Sub(ended) >= s.cfg.ReturnWait {
		return nil
	}
	timer := s.cfg.Clock.NewTimer(ended.Add(s.cfg.ReturnWait).Sub(now))
	defer timer.Stop()
	for {
		s.mu.Lock()
		if s.draining {
			s.mu.Unlock()
			return nil
		}
		arrived, ok := s.arrived[key]
		if !ok {
			arrived = make(chan struct{})
			s.arrived[key] = arrived
		}
		s.mu.Unlock()
		// A stream admitted since the caller looked is live already.
		if live := s.live(cluster); len(live) > 0 {
			return live
		}
		select {
		case <-arrived: // a stream of the cluster, maybe of another incarnation, or Drain
		case <-timer.C():
			return nil
		case <-ctx.Done():
			return nil
		}
	}
}

// sessionsChanged calls OnSessionsChange, if set.
func (s *Server) sessionsChanged(key types.NamespacedName) {
	if s.cfg.OnSessionsChange != nil {
		s.cfg.OnSessionsChange(key)
	}
}

// live returns the sessions that serve cluster and take new requests: the
// open ones (isOpen), and of those of one agent instance, the newest.
func (s *Server) live(cluster fleet.ClusterRef) []*session {
	s.mu.RLock()
	defer s.mu.RUnlock()
	list := s.sessions[cluster.NamespacedName]
	var out []*session
	newest := map[agentInstance]bool{}
	for i := len(list) - 1; i >= 0; i-- { // newest first
		sess := list[i]
		if sess.cluster.UID != cluster.UID || !sess.isOpen() {
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

// isLeaving reports whether the agent of the session said goodbye.
func (sess *session) isLeaving() bool { return sess.leaving.Load() }

// isOpen reports whether the session serves: its checks passed, it is not
// closed, and its agent has not said goodbye.
func (sess *session) isOpen() bool {
	return sess.serving.Load() && sess.ctx.Err() == nil && !sess.isLeaving()
}

// agentInstance names one agent's Client: its SPIFFE ID and instanceHeader.
type agentInstance struct {
	id       spiffeid.ID
	instance string
}

// Pending reports how many mints and revokes wait for an agent's answer.
func (s *Server) Pending() int { return int(s.pending.Load()) }

// Connected reports how many live sessions serve cluster.
func (s *Server) Connected(cluster fleet.ClusterRef) int { return len(s.live(cluster)) }

// ConnectedClusters reports how many clusters have at least one open
// session (isOpen).
func (s *Server) ConnectedClusters() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	n := 0
	for _, list := range s.sessions {
		if slices.ContainsFunc(list, (*session).isOpen) {
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
// cluster that advertise no server (Advertised counts those that do),
// oldest first. Like Advertised, it picks none.
func (s *Server) DataPaths(cluster fleet.ClusterRef) (offers []DataPathOffer) {
	list := s.live(cluster)
	for _, sess := range list {
		dp := sess.hello.GetDataPath()
		if dp == nil || sess.hello.GetServer() != "" {
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
