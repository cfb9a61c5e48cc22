package agent

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fakeDNS answers lookups with what the test sets.
type fakeDNS struct {
	mu      sync.Mutex
	ips     []string
	err     error
	lookups int
}

// lookupCount is how many lookups the fanout has made.
func (d *fakeDNS) lookupCount() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.lookups
}

func (d *fakeDNS) set(err error, ips ...string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.ips, d.err = ips, err
}

func (d *fakeDNS) lookup(_ context.Context, host string) ([]string, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.lookups++
	return slices.Clone(d.ips), d.err
}

// streams records which addresses have a live stream.
type streams struct {
	mu   sync.Mutex
	live map[string]int
}

func (s *streams) serve(ctx context.Context, addr string, connected func()) error {
	s.mu.Lock()
	s.live[addr]++
	s.mu.Unlock()
	connected()
	<-ctx.Done()
	s.mu.Lock()
	s.live[addr]--
	if s.live[addr] == 0 {
		delete(s.live, addr)
	}
	s.mu.Unlock()
	return nil
}

func (s *streams) addrs() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for a := range s.live {
		out = append(out, a)
	}
	slices.Sort(out)
	return out
}

func TestFanoutFollowsReplicas(t *testing.T) {
	dns := &fakeDNS{}
	dns.set(nil, "10.0.0.1", "10.0.0.2")
	s := &streams{live: map[string]int{}}
	f := newFanout("broker-agents.credbroker-system.svc:8444", time.Millisecond, dns.lookup, s.serve, logr.Discard())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()

	eventually := func(want ...string) {
		t.Helper()
		require.Eventually(t, func() bool { return slices.Equal(s.addrs(), want) }, 10*time.Second, time.Millisecond, "want streams to %v", want)
	}
	eventually("10.0.0.1:8444", "10.0.0.2:8444")
	<-f.connected

	dns.set(nil, "10.0.0.2", "10.0.0.3") // a replica was replaced
	eventually("10.0.0.2:8444", "10.0.0.3:8444")

	dns.set(errors.New("no such host")) // DNS trouble keeps the streams
	failedFrom := dns.lookupCount()
	require.Eventually(t, func() bool { return dns.lookupCount() >= failedFrom+2 }, 10*time.Second, time.Millisecond,
		"the fanout did not look the target up again")
	assert.Equal(t, []string{"10.0.0.2:8444", "10.0.0.3:8444"}, s.addrs())

	cancel()
	require.NoError(t, <-done)
	assert.Empty(t, s.addrs())
}

// After a replica says it drains, its replacement is found at once rather
// than at the next interval, and for an interval after.
func TestFanoutResolvesSoonAfterADrain(t *testing.T) {
	dns := &fakeDNS{}
	dns.set(nil, "10.0.0.1")
	s := &streams{live: map[string]int{}}
	f := newFanout("broker-agents.credbroker-system.svc:8444", time.Hour, dns.lookup, s.serve, logr.Discard())
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = f.Run(ctx) }()
	<-f.connected

	dns.set(nil, "10.0.0.2") // the replica was replaced
	f.resolveSoon()
	require.Eventually(t, func() bool { return slices.Equal(s.addrs(), []string{"10.0.0.2:8444"}) }, 10*time.Second, time.Millisecond,
		"the replacement is found without waiting the hour")
	dns.set(nil, "10.0.0.3") // and the one after it, within the fast interval
	require.Eventually(t, func() bool { return slices.Equal(s.addrs(), []string{"10.0.0.3:8444"}) }, 10*time.Second, 10*time.Millisecond)
}

func TestFanoutIPTargetIsNotResolved(t *testing.T) {
	s := &streams{live: map[string]int{}}
	lookup := func(context.Context, string) ([]string, error) {
		t.Error("an IP target was resolved")
		return nil, nil
	}
	f := newFanout("127.0.0.1:8444", time.Millisecond, lookup, s.serve, logr.Discard())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	<-f.connected
	assert.Equal(t, []string{"127.0.0.1:8444"}, s.addrs())
	cancel()
	require.NoError(t, <-done)
}

func TestConfigValidate(t *testing.T) {
	cfg := Default()
	cfg.BrokerAddresses = []string{"broker"}
	err := cfg.Validate()
	require.Error(t, err)
	assert.Contains(t, err.Error(), `broker address "broker" is not host:port`)
	assert.Contains(t, err.Error(), "the trust domain is required")
	assert.Contains(t, err.Error(), "a spoke client config is required")
}
