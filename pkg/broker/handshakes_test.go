package broker

import (
	"net"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/credentials"
)

// computingCreds' server handshakes read one byte from their client, then
// compute until release is closed, then read one more.
type computingCreds struct {
	credentials.TransportCredentials
	release chan struct{}
}

func (c *computingCreds) Clone() credentials.TransportCredentials { return c }

func (c *computingCreds) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	b := make([]byte, 1)
	if _, err := conn.Read(b); err != nil {
		return nil, nil, err
	}
	<-c.release
	if _, err := conn.Read(b); err != nil {
		return nil, nil, err
	}
	return conn, nil, nil
}

// handshake runs creds' server handshake on one end of a pipe, in the
// background, and returns the client's end and the handshake's result.
func handshake(creds credentials.TransportCredentials) (client net.Conn, done <-chan error) {
	server, client := net.Pipe()
	ch := make(chan error, 1)
	go func() {
		_, _, err := creds.Clone().ServerHandshake(server)
		ch <- err
	}()
	return client, ch
}

// Handshakes that compute beyond the port's turns wait, and one that waits
// too long is refused, so that a herd of reconnecting clients cannot fill
// the run queue. A handshake waiting for its client holds no turn, so
// clients that send nothing keep no one waiting.
func TestHandshakesTakeTurns(t *testing.T) {
	m, err := newHandshakeMetrics(prometheus.NewRegistry())
	require.NoError(t, err)
	inner := &computingCreds{release: make(chan struct{})}
	creds := m.limitHandshakes("agent", inner).(*turnTaking)
	creds.turns = make(chan struct{}, 2)
	creds.wait = time.Hour
	waiting := func() float64 { return testutil.ToFloat64(m.waiting.WithLabelValues("agent")) }

	// Silent clients: as many as there are turns, and more.
	for range 4 {
		silent, _ := handshake(creds)
		defer silent.Close()
	}
	// Four clients that send their first byte: two compute, two wait.
	var clients []net.Conn
	var results []<-chan error
	for range 4 {
		c, done := handshake(creds)
		defer c.Close()
		_, err := c.Write([]byte{1})
		require.NoError(t, err)
		clients, results = append(clients, c), append(results, done)
	}
	require.Eventually(t, func() bool { return waiting() == 2 }, 10*time.Second, time.Millisecond,
		"two compute, two wait their turn; the silent clients hold none")

	// A handshake that cannot get a turn in time is refused.
	quick := *creds
	quick.wait = 10 * time.Millisecond
	c, done := handshake(&quick)
	defer c.Close()
	_, err = c.Write([]byte{1})
	require.NoError(t, err)
	assert.ErrorIs(t, <-done, errHandshakeBusy)
	assert.Equal(t, 1.0, testutil.ToFloat64(m.refused.WithLabelValues("agent")))

	// Each gives its turn back while it waits for its client again.
	close(inner.release)
	require.Eventually(t, func() bool { return waiting() == 0 }, 10*time.Second, time.Millisecond)
	for i, c := range clients {
		_, err := c.Write([]byte{2})
		require.NoError(t, err)
		require.NoError(t, <-results[i])
	}
	assert.Empty(t, creds.turns, "every turn was given back")
}
