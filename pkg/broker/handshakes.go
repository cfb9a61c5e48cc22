package broker

import (
	"errors"
	"net"
	"runtime"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/credentials"

	"github.com/credbroker/credbroker/internal/metrics"
)

// When a broker restarts, every agent and consumer connects again at once.
// Each TLS handshake is about a millisecond of CPU; thousands at once fill
// the run queue, so the pings of connections already made are answered
// seconds late, their keepalives end them, and they connect again: the
// herd feeds itself. So each port runs at most handshakesPerCPU handshakes
// per CPU at a time; one that waits for a turn longer than handshakeWait is
// refused (the connection is closed), and its client backs off and comes
// back later. Waiting handshakes are not runnable: they cost nothing.
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
	select {
	case t.turns <- struct{}{}:
	default:
		t.waiting.Inc()
		timer := time.NewTimer(t.wait)
		select {
		case t.turns <- struct{}{}:
			timer.Stop()
			t.waiting.Dec()
		case <-timer.C:
			t.waiting.Dec()
			t.refused.Inc()
			return nil, nil, errHandshakeBusy
		}
	}
	defer func() { <-t.turns }()
	return t.TransportCredentials.ServerHandshake(conn)
}

func (t *turnTaking) Clone() credentials.TransportCredentials {
	c := *t
	c.TransportCredentials = t.TransportCredentials.Clone()
	return &c
}
