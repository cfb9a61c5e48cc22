package broker

import (
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/credentials"
)

// blockingCreds' server handshakes run until release is closed.
type blockingCreds struct {
	credentials.TransportCredentials
	running atomic.Int32
	release chan struct{}
}

func (b *blockingCreds) Clone() credentials.TransportCredentials { return b }

func (b *blockingCreds) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	b.running.Add(1)
	defer b.running.Add(-1)
	<-b.release
	return conn, nil, nil
}

// Handshakes beyond the port's turns wait, and one that waits too long is
// refused, so that a herd of reconnecting clients cannot fill the run
// queue; those in turn are not slowed.
func TestHandshakesTakeTurns(t *testing.T) {
	m, err := newHandshakeMetrics(prometheus.NewRegistry())
	require.NoError(t, err)
	inner := &blockingCreds{release: make(chan struct{})}
	creds := m.limitHandshakes("agent", inner).(*turnTaking)
	creds.turns = make(chan struct{}, 2)
	creds.wait = time.Hour

	done := make(chan error, 4)
	for range 4 {
		go func() {
			_, _, err := creds.Clone().ServerHandshake(nil)
			done <- err
		}()
	}
	require.Eventually(t, func() bool { return testutil.ToFloat64(m.waiting.WithLabelValues("agent")) == 2 }, 10*time.Second, time.Millisecond)
	assert.Equal(t, int32(2), inner.running.Load(), "two run, two wait their turn")

	// A handshake that cannot get a turn in time is refused.
	quick := *creds
	quick.wait = 10 * time.Millisecond
	_, _, err = quick.ServerHandshake(nil)
	assert.ErrorIs(t, err, errHandshakeBusy)
	assert.Equal(t, 1.0, testutil.ToFloat64(m.refused.WithLabelValues("agent")))

	close(inner.release)
	for range 4 {
		require.NoError(t, <-done)
	}
	assert.Equal(t, 0.0, testutil.ToFloat64(m.waiting.WithLabelValues("agent")))
}
