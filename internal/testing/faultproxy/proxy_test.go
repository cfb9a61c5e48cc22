package faultproxy_test

import (
	"bufio"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/credbroker/credbroker/internal/testing/faultproxy"
)

// echoServer answers every line with the same line.
func echoServer(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = lis.Close() })
	go func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					if _, err := c.Write([]byte(line)); err != nil {
						return
					}
				}
			}()
		}
	}()
	return lis.Addr().String()
}

// roundTrip sends a line and waits up to wait for its echo.
func roundTrip(c net.Conn, r *bufio.Reader, wait time.Duration) error {
	if _, err := c.Write([]byte("ping\n")); err != nil {
		return err
	}
	_ = c.SetReadDeadline(time.Now().Add(wait))
	_, err := r.ReadString('\n')
	return err
}

func TestPartitionStallsAndHealResumes(t *testing.T) {
	p, err := faultproxy.New(echoServer(t))
	require.NoError(t, err)
	defer p.Close()

	c, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	defer c.Close()
	r := bufio.NewReader(c)
	require.NoError(t, roundTrip(c, r, 10*time.Second))
	require.Equal(t, 1, p.Conns())

	p.Partition()
	err = roundTrip(c, r, 300*time.Millisecond)
	var ne net.Error
	require.ErrorAs(t, err, &ne, "a partition must stall, not reset")
	require.True(t, ne.Timeout())
	require.Equal(t, 1, p.Conns(), "the connection stays open through a partition")

	p.Heal()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	line, err := r.ReadString('\n')
	require.NoError(t, err, "the stalled line arrives once healed")
	require.Equal(t, "ping\n", line)
}

func TestDownResetsAndRefusesUntilHealed(t *testing.T) {
	p, err := faultproxy.New(echoServer(t))
	require.NoError(t, err)
	defer p.Close()

	c, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	defer c.Close()
	r := bufio.NewReader(c)
	require.NoError(t, roundTrip(c, r, 10*time.Second))

	p.Down()
	require.Error(t, roundTrip(c, r, 10*time.Second), "an open connection is reset")
	if again, err := net.Dial("tcp", p.Addr()); err == nil { // the reset may come before or after the handshake ends
		require.Error(t, roundTrip(again, bufio.NewReader(again), 10*time.Second), "a new connection is reset")
		_ = again.Close()
	}
	require.Zero(t, p.Conns())

	p.Heal()
	healed, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	defer healed.Close()
	require.NoError(t, roundTrip(healed, bufio.NewReader(healed), 10*time.Second))
}
