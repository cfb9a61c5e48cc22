package framework

import (
	"net"
	"os"
	"runtime"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Two processes given FreeAddr's addresses never get the same one.
func TestFreeAddrNeverRepeats(t *testing.T) {
	seen := map[string]bool{}
	for range 200 {
		addr, err := FreeAddr()
		require.NoError(t, err)
		require.False(t, seen[addr], "FreeAddr handed out %s twice", addr)
		seen[addr] = true
	}
}

// listeningPorts names the ports a process listens on, and no other.
func TestListeningPorts(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("reads Linux's /proc")
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := lis.Addr().(*net.TCPAddr).Port
	assert.True(t, listeningPorts(os.Getpid())[port], "port %d of this process", port)
	require.NoError(t, lis.Close())
	assert.False(t, listeningPorts(os.Getpid())[port], "port %d after its listener closed", port)
}

// A process that exits because its address is taken fails waitBound with
// ErrAddrInUse, and its output in the error.
func TestWaitBoundTellsATakenAddress(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("reads Linux's /proc")
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer lis.Close()
	addr := lis.Addr().String()
	p, err := StartProcess("/bin/sh", "-c", "echo 'exchange listener: listen tcp "+addr+": bind: address already in use' >&2; exit 1")
	require.NoError(t, err)
	err = p.waitBound(addr)
	require.ErrorIs(t, err, ErrAddrInUse)
	assert.Contains(t, err.Error(), "listen tcp "+addr)
	assert.True(t, p.AddrInUse())

	p, err = StartProcess("/bin/sh", "-c", "echo 'no such flag' >&2; exit 2")
	require.NoError(t, err)
	err = p.waitBound("127.0.0.1:" + strconv.Itoa(lis.Addr().(*net.TCPAddr).Port))
	require.Error(t, err)
	assert.NotErrorIs(t, err, ErrAddrInUse)
	assert.Contains(t, err.Error(), "no such flag")
	assert.False(t, p.AddrInUse())
}
