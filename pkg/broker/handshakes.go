package broker

import (
	"errors"
	"net"
	"runtime"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/credentials"

	"github.com/credbroker/credbroker/internal/metrics"
)

// When a broker restarts, every agent and consumer connects again at once.
// Each TLS handshake is about a millisecond of CPU; thousands at once fill
// the run queue, so the pings of connections already made are answered
// seconds late, their keepalives end them, and they connect again: the
// herd feeds itself. So on each port at most handshakesPerCPU handshakes
// per CPU compute at a time. A handshake holds a turn only from the moment
// a read from its client returns until its next read: while it waits for
// its client it holds none, so a client that sends nothing, or half a
// ClientHello, keeps no one else waiting. One that waits for a turn longer
// than handshakeWait is refused (the connection is closed), and its client
// backs off and comes back later. Waiting handshakes are not runnable: they
// cost nothing.
const (
	handshakesPerCPU = 16
	handshakeWait    = 10 * time.Second
)

var errHandshakeBusy = errors.New("broker: too many TLS handshakes waiting; the client backs off and comes again")

// handshakeMetrics count, per port, the handshakes waiting for their turn
// and those refused.
type handshakeMetrics struct {
	waiting *prometheus.GaugeVec
	refused *prometheus.CounterVec
}

func newHandshakeMetrics(reg prometheus.Registerer) (*handshakeMetrics, error) {
	m := &handshakeMetrics{
		waiting: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: "credbroker",
			Name:      "tls_handshakes_waiting",
			Help:      "TLS handshakes waiting for their turn, by port (exchange, agent): the broker runs a few per CPU at a time.",
		}, []string{"port"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "credbroker",
			Name:      "tls_handshakes_refused_total",
			Help:      "Connections closed because their TLS handshake waited too long for its turn, by port (exchange, agent).",
		}, []string{"port"}),
	}
	for _, port := range []string{"exchange", "agent"} {
		m.waiting.WithLabelValues(port)
		m.refused.WithLabelValues(port)
	}
	return m, metrics.Register(reg, m.waiting, m.refused)
}

// limitHandshakes returns creds whose server handshakes on port take turns.
func (m *handshakeMetrics) limitHandshakes(port string, creds credentials.TransportCredentials) credentials.TransportCredentials {
	return &turnTaking{
		TransportCredentials: creds,
		turns:                make(chan struct{}, handshakesPerCPU*runtime.GOMAXPROCS(0)),
		wait:                 handshakeWait,
		waiting:              m.waiting.WithLabelValues(port),
		refused:              m.refused.WithLabelValues(port),
	}
}

// turnTaking is credentials whose ServerHandshake waits for one of turns.
type turnTaking struct {
	credentials.TransportCredentials
	turns   chan struct{}
	wait    time.Duration
	waiting prometheus.Gauge
	refused prometheus.Counter
}

func (t *turnTaking) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	tc := &turnConn{Conn: conn, turns: t}
	out, info, err := t.TransportCredentials.ServerHandshake(tc)
	tc.handshaken()
	return out, info, err
}

// take waits for a turn, for t.wait at most.
func (t *turnTaking) take() error {
	select {
	case t.turns <- struct{}{}:
		return nil
	default:
	}
	t.waiting.Inc()
	defer t.waiting.Dec()
	timer := time.NewTimer(t.wait)
	defer timer.Stop()
	select {
	case t.turns <- struct{}{}:
		return nil
	case <-timer.C:
		t.refused.Inc()
		return errHandshakeBusy
	}
}

func (t *turnTaking) give() { <-t.turns }

// turnConn is a connection whose handshake takes a turn after each read
// and gives it back before the next; once the handshake is over, its reads
// are the connection's own.
type turnConn struct {
	net.Conn
	turns *turnTaking
	// held is touched only by the handshake's goroutine.
	held bool
	done atomic.Bool
}

func (c *turnConn) Read(b []byte) (int, error) {
	if c.done.Load() {
		return c.Conn.Read(b)
	}
	if c.held {
		c.turns.give()
		c.held = false
	}
	n, err := c.Conn.Read(b)
	if err != nil {
		return n, err
	}
	if err := c.turns.take(); err != nil {
		return n, err
	}
	c.held = true
	return n, nil
}

// SyscallConn is the connection's own, for the socket options that gRPC
// sets and reads.
func (c *turnConn) SyscallConn() (syscall.RawConn, error) {
	sc, ok := c.Conn.(syscall.Conn)
	if !ok {
		return nil, errors.New("broker: the connection has no file descriptor")
	}
	return sc.SyscallConn()
}

// handshaken gives back the turn the handshake holds, if any, and lets
// reads through from now on.
func (c *turnConn) handshaken() {
	if c.held {
		c.turns.give()
		c.held = false
	}
	c.done.Store(true)
}

func (t *turnTaking) Clone() credentials.TransportCredentials {
	c := *t
	c.TransportCredentials = t.TransportCredentials.Clone()
	return &c
}
