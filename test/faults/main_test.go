package faults

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"k8s.io/client-go/rest"

	"github.com/credbroker/credbroker/internal/testing/faultproxy"
	"github.com/credbroker/credbroker/pkg/agent"
	"github.com/credbroker/credbroker/pkg/broker"
	"github.com/credbroker/credbroker/test/framework"
)

// The environment every fault test shares:
//   - the broker reaches the hub through hubProxy;
//   - spoke-1 has two agents, both reaching their spoke through spokeProxy;
//     agent A reaches the broker through agentProxy, agent B directly;
//   - spoke-2 has one agent whose spoke answers TokenRequests after
//     slowSpoke, and patches of Secrets after slowClaims, while they are
//     non-zero, and fails its patches and deletes of Secrets while
//     failGrantWrites is set.
var (
	env        *framework.Env
	deployment *framework.Deployment
	spoke1     *framework.Cluster
	spoke2     *framework.Cluster
	hubProxy   *faultproxy.Proxy
	spokeProxy *faultproxy.Proxy
	agentProxy *faultproxy.Proxy
	slowSpoke  atomic.Int64 // a time.Duration
	slowClaims atomic.Int64 // a time.Duration
	// failGrantWrites fails spoke-2's agent's patches and deletes of
	// Secrets while set.
	failGrantWrites atomic.Bool
	// agentBin and brokerBin are the shipped binaries, built from this tree.
	agentBin, brokerBin string

	mintTimeout = 10 * time.Second
	// Keepalives of the agent-broker path: a silent partition ends the
	// stream within keepaliveTime+keepaliveTimeout on the broker's side.
	keepaliveTime, keepaliveTimeout = 2 * time.Second, 2 * time.Second
	// The broker's decision caches, short enough that a test sees them
	// expire.
	decisionTTL = 4 * time.Second
)

func TestMain(m *testing.M) {
	if cfg := os.Getenv(bomberEnv); cfg != "" {
		os.Exit(runBomber(cfg))
	}
	os.Exit(run(m))
}

func run(m *testing.M) int {
	flag.Parse()
	defer framework.WatchStuckTests(os.Stderr)()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dir, err := os.MkdirTemp("", "credbroker-faults-")
	if err != nil {
		return fail(err)
	}
	defer os.RemoveAll(dir)

	agentBin, brokerBin = filepath.Join(dir, "spoke-agent"), filepath.Join(dir, "broker")
	if err := framework.Build(ctx, dir, "spoke-agent", "broker"); err != nil {
		return fail(err)
	}

	if env, err = framework.Start(ctx, framework.Options{Spokes: 2}); err != nil {
		return fail(err)
	}
	defer env.Stop()
	spoke1, spoke2 = env.Spokes[0], env.Spokes[1]

	if hubProxy, err = proxyTo(env.Hub.Server); err != nil {
		return fail(err)
	}
	defer hubProxy.Close()
	if spokeProxy, err = proxyTo(spoke1.Server); err != nil {
		return fail(err)
	}
	defer spokeProxy.Close()

	logger := funcr.New(func(prefix, args string) {
		if os.Getenv("FAULTS_LOGS") != "" {
			fmt.Fprintln(os.Stderr, prefix, args)
		}
	}, funcr.Options{})
	if deployment, err = framework.StartDeployment(ctx, env, framework.DeploymentOptions{
		Dir: dir, Log: logger, Audit: logger.WithName("audit"), MintTimeout: mintTimeout,
		Tune: func(c *broker.Config) {
			c.Hub = rest.CopyConfig(c.Hub)
			c.Hub.Host = "https://" + hubProxy.Addr()
			c.AgentKeepaliveTime, c.AgentKeepaliveTimeout = keepaliveTime, keepaliveTimeout
			c.AuthnTTL, c.AllowTTL = decisionTTL, decisionTTL
		},
	}); err != nil {
		return fail(err)
	}
	defer deployment.Stop()
	if agentProxy, err = faultproxy.New(deployment.Broker.AgentAddr()); err != nil {
		return fail(err)
	}
	defer agentProxy.Close()

	viaSpokeProxy := func(c *agent.Config) {
		c.Spoke = rest.CopyConfig(c.Spoke)
		c.Spoke.Host = "https://" + spokeProxy.Addr()
		c.KeepaliveTime, c.KeepaliveTimeout = 10*time.Second, keepaliveTimeout
	}
	agents := []struct {
		spoke *framework.Cluster
		tune  func(*agent.Config)
	}{
		{spoke1, func(c *agent.Config) { viaSpokeProxy(c); c.BrokerAddresses = []string{agentProxy.Addr()} }},
		{spoke1, viaSpokeProxy},
		{spoke2, func(c *agent.Config) { c.Spoke = rest.CopyConfig(c.Spoke); c.Spoke.Wrap(slowSpokeRequests) }},
	}
	for _, a := range agents {
		if _, err := deployment.StartAgentWith(ctx, a.spoke, framework.AgentOptions{
			ID: framework.AgentID(a.spoke.Name), Tune: a.tune,
		}); err != nil {
			return fail(err)
		}
	}
	return m.Run()
}

// proxyTo starts a fault proxy in front of an https URL.
func proxyTo(server string) (*faultproxy.Proxy, error) {
	u, err := url.Parse(server)
	if err != nil {
		return nil, err
	}
	return faultproxy.New(u.Host)
}

// errGrantWrites is the error of a patch or delete of a Secret while
// failGrantWrites is set.
var errGrantWrites = errors.New("faults: the spoke's etcd is down")

// slowSpokeRequests delays every TokenRequest by slowSpoke, and every
// patch of a Secret (a grant's claim) by slowClaims; it fails every patch
// and delete of a Secret while failGrantWrites is set.
func slowSpokeRequests(rt http.RoundTripper) http.RoundTripper {
	return roundTripperFunc(func(r *http.Request) (*http.Response, error) {
		if failGrantWrites.Load() && (r.Method == http.MethodPatch || r.Method == http.MethodDelete) && strings.Contains(r.URL.Path, "/secrets/") {
			return nil, errGrantWrites
		}
		var d time.Duration
		switch {
		case r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/token"):
			d = time.Duration(slowSpoke.Load())
		case r.Method == http.MethodPatch && strings.Contains(r.URL.Path, "/secrets/"):
			d = time.Duration(slowClaims.Load())
		}
		if d > 0 {
			select {
			case <-time.After(d):
			case <-r.Context().Done():
				return nil, r.Context().Err()
			}
		}
		return rt.RoundTrip(r)
	})
}

type roundTripperFunc func(*http.Request) (*http.Response, error)

func (f roundTripperFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

func fail(err error) int {
	fmt.Fprintln(os.Stderr, "faults: setup failed:", err)
	return 1
}
