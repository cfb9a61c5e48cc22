package tunnel

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/credentials/insecure"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// The defaults and bounds of NewClient. Most of them only time things
// (backoff, keepalive, drain), which no test observes without timing, so
// they are read from the Client's config.
func TestNewClientDefaults(t *testing.T) {
	base := ClientConfig{Address: "broker:443", Credentials: insecure.NewCredentials(), Minter: &fakeMinter{}}
	defaults := func(c ClientConfig) ClientConfig {
		c.Hello = &pb.Hello{}
		c.MintTimeout, c.MaxInFlight, c.MaxQueuedGrantUpdates = 10*time.Second, 64, 1024
		c.InitialBackoff, c.MaxBackoff = 500*time.Millisecond, 30*time.Second
		c.Keepalive, c.KeepaliveTimeout, c.DrainTimeout = 10*time.Second, 5*time.Second, 15*time.Second
		return c
	}
	tests := []struct {
		name string
		cfg  func(*ClientConfig)
		want func(*ClientConfig)
	}{
		{name: "zero", cfg: func(*ClientConfig) {}, want: func(*ClientConfig) {}},
		{
			name: "negative",
			cfg: func(c *ClientConfig) {
				c.MintTimeout, c.MaxInFlight, c.MaxQueuedGrantUpdates = -1, -1, -1
				c.InitialBackoff, c.MaxBackoff = -1, -1
				c.Keepalive, c.KeepaliveTimeout, c.DrainTimeout = -1, -1, -1
			},
			want: func(*ClientConfig) {},
		},
		{
			name: "given",
			cfg: func(c *ClientConfig) {
				c.Hello = &pb.Hello{Server: "https://spoke.example:6443"}
				c.MintTimeout, c.MaxInFlight, c.MaxQueuedGrantUpdates = time.Second, 1, 1
				c.InitialBackoff, c.MaxBackoff = time.Millisecond, 2*time.Millisecond
				c.Keepalive, c.KeepaliveTimeout, c.DrainTimeout = time.Minute, time.Minute, time.Minute
			},
			want: func(c *ClientConfig) {
				c.Hello = &pb.Hello{Server: "https://spoke.example:6443"}
				c.MintTimeout, c.MaxInFlight, c.MaxQueuedGrantUpdates = time.Second, 1, 1
				c.InitialBackoff, c.MaxBackoff = time.Millisecond, 2*time.Millisecond
				c.Keepalive, c.KeepaliveTimeout, c.DrainTimeout = time.Minute, time.Minute, time.Minute
			},
		},
		{
			name: "MaxBackoff equal to InitialBackoff",
			cfg:  func(c *ClientConfig) { c.InitialBackoff, c.MaxBackoff = time.Second, time.Second },
			want: func(c *ClientConfig) { c.InitialBackoff, c.MaxBackoff = time.Second, time.Second },
		},
		{
			name: "MaxBackoff under InitialBackoff",
			cfg:  func(c *ClientConfig) { c.InitialBackoff, c.MaxBackoff = 2*time.Second, time.Second },
			want: func(c *ClientConfig) { c.InitialBackoff, c.MaxBackoff = 2*time.Second, 30*time.Second },
		},
		{
			name: "InitialBackoff over the default MaxBackoff",
			cfg:  func(c *ClientConfig) { c.InitialBackoff = time.Minute },
			want: func(c *ClientConfig) { c.InitialBackoff, c.MaxBackoff = time.Minute, time.Minute },
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := base
			tt.cfg(&cfg)
			c, err := NewClient(cfg)
			require.NoError(t, err)
			want := defaults(base)
			tt.want(&want)
			got := c.cfg
			assert.Equal(t, want.Hello.String(), got.Hello.String())
			got.Hello, want.Hello = nil, nil
			assert.Equal(t, want, got)
		})
	}
}

// The defaults of NewServer: a zero MaxStreamsPerCluster must not refuse
// every agent, and zero timeouts must not give up at once.
func TestNewServerDefaults(t *testing.T) {
	h := newHarness(t, 0)
	for _, tt := range []struct {
		name string
		cfg  func(*ServerConfig)
	}{
		{name: "zero", cfg: func(*ServerConfig) {}},
		{name: "negative", cfg: func(c *ServerConfig) { c.MintTimeout, c.HelloTimeout, c.MaxStreamsPerCluster = -1, -1, -1 }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cfg := ServerConfig{Resolver: h.resolver, Peer: h.peers.peer, Bundles: h.bundles}
			tt.cfg(&cfg)
			s, err := NewServer(cfg)
			require.NoError(t, err)
			assert.Equal(t, 10*time.Second, s.cfg.MintTimeout)
			assert.Equal(t, 10*time.Second, s.cfg.HelloTimeout)
			assert.Equal(t, 512, s.cfg.MaxStreamsPerCluster)
			assert.NotNil(t, s.cfg.Clock)
			assert.Equal(t, noGrants{}, s.cfg.Grants)
		})
	}
}

// The broker learns the spoke's server and CA from the hello the Client is
// configured with, and reports every distinct one of the live streams,
// oldest first, without picking one: a newer stream that advertises
// another server does not replace the first.
func TestHelloReachesTheBroker(t *testing.T) {
	h := newHarness(t, 5*time.Second, func(c *ServerConfig) { c.MaxStreamsPerCluster = 8 })
	ca := []byte("-----BEGIN CERTIFICATE-----\nspoke CA\n-----END CERTIFICATE-----\n")
	ads, live := h.srv.Advertised(clusterA)
	assert.Empty(t, ads)
	assert.Zero(t, live)

	hello := &pb.Hello{AgentVersion: "test", Server: "https://spoke.example:6443", CertificateAuthorityData: ca}
	h.agent(t, agentA, &fakeMinter{}, func(c *ClientConfig) { c.Hello = hello })
	waitConnected(t, h, clusterA, 1)
	ads, live = h.srv.Advertised(clusterA)
	assert.Equal(t, []Advertisement{{Server: "https://spoke.example:6443", CAData: ca, Streams: 1}}, ads)
	assert.Equal(t, 1, live)

	// A second agent of the cluster that advertises nothing adds nothing.
	h.agent(t, agentA, &fakeMinter{}, func(c *ClientConfig) { c.Hello = &pb.Hello{AgentVersion: "test"} })
	waitConnected(t, h, clusterA, 2)
	ads, live = h.srv.Advertised(clusterA)
	assert.Equal(t, []Advertisement{{Server: "https://spoke.example:6443", CAData: ca, Streams: 1}}, ads)
	assert.Equal(t, 2, live)

	// One that advertises the same server and CA is counted with the
	// first; one with another CA, and one with another server, are listed
	// after it.
	h.agent(t, agentA, &fakeMinter{}, func(c *ClientConfig) { c.Hello = hello })
	waitConnected(t, h, clusterA, 3)
	h.agent(t, agentA, &fakeMinter{}, func(c *ClientConfig) {
		c.Hello = &pb.Hello{AgentVersion: "test", Server: "https://spoke.example:6443", CertificateAuthorityData: []byte("other")}
	})
	waitConnected(t, h, clusterA, 4)
	h.agent(t, agentA, &fakeMinter{}, func(c *ClientConfig) {
		c.Hello = &pb.Hello{AgentVersion: "test", Server: "https://decoy.example:443", CertificateAuthorityData: ca}
	})
	waitConnected(t, h, clusterA, 5)
	ads, live = h.srv.Advertised(clusterA)
	assert.Equal(t, []Advertisement{
		{Server: "https://spoke.example:6443", CAData: ca, Streams: 2},
		{Server: "https://spoke.example:6443", CAData: []byte("other"), Streams: 1},
		{Server: "https://decoy.example:443", CAData: ca, Streams: 1},
	}, ads)
	assert.Equal(t, 5, live)
}

// A stream's vote for the published server is the server it advertises,
// or, when it advertises none, the data path it offers: DataPaths counts
// only the streams that advertise no server, so that agents that both
// advertise a server and offer a data path agree on their server.
func TestDataPathsCountStreamsWithoutAServer(t *testing.T) {
	h := newHarness(t, 5*time.Second, func(c *ServerConfig) { c.MaxStreamsPerCluster = 8 })
	dp := &pb.DataPath{ServerName: "spoke.internal", CertificateAuthorityData: []byte("spoke CA")}
	h.agent(t, agentA, &fakeMinter{}, func(c *ClientConfig) {
		c.Hello = &pb.Hello{AgentVersion: "test", Server: "https://spoke.example:6443", DataPath: dp}
	})
	waitConnected(t, h, clusterA, 1)
	assert.Empty(t, h.srv.DataPaths(clusterA), "a stream that advertises a server votes for it alone")

	h.agent(t, agentA, &fakeMinter{}, func(c *ClientConfig) { c.Hello = &pb.Hello{AgentVersion: "test", DataPath: dp} })
	h.agent(t, agentA, &fakeMinter{}, func(c *ClientConfig) { c.Hello = &pb.Hello{AgentVersion: "test"} })
	waitConnected(t, h, clusterA, 3)
	assert.Equal(t, []DataPathOffer{{ServerName: "spoke.internal", CAData: []byte("spoke CA"), Streams: 1}}, h.srv.DataPaths(clusterA))
}

// Each reconnect waits between half the backoff and the whole of it, and
// reaches both ends (the whole less a nanosecond for an odd one).
func TestJitterStaysWithinTheBackoff(t *testing.T) {
	for _, d := range []time.Duration{0, 1, 2, 3, 10} {
		lo, hi := d, time.Duration(0)
		for range 1000 {
			w := jitter(d)
			require.GreaterOrEqual(t, w, d/2, "backoff %d", d)
			require.LessOrEqual(t, w, d, "backoff %d", d)
			lo, hi = min(lo, w), max(hi, w)
		}
		assert.Equal(t, d/2, lo, "backoff %d: the shortest wait is never drawn", d)
		assert.Equal(t, d/2*2, hi, "backoff %d: the longest wait is never drawn", d)
	}
	w := jitter(time.Second)
	assert.True(t, w >= 500*time.Millisecond && w <= time.Second, "backoff 1s: waited %v", w)
}
