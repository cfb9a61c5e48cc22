package faults

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// procFleet is the shipped broker binary and a spoke-agent binary of
// spoke-1 connected to it alone, as processes whose /metrics tell their own
// goroutines and memory, apart from the test's. The agents of the
// deployment do not connect to this broker.
type procFleet struct {
	brokerOpts framework.BrokerProcessOptions
	broker     *framework.Process
	agentOpts  framework.AgentProcessOptions
	agent      *framework.Process
	// agentMetrics is the agent's --metrics-address.
	agentMetrics string
	client       pb.TokenExchangeClient
}

func startProcFleet(t *testing.T) *procFleet {
	t.Helper()
	addrs := make([]string, 4)
	for i := range addrs {
		var err error
		addrs[i], err = framework.FreeAddr()
		require.NoError(t, err)
	}
	f := &procFleet{
		brokerOpts: framework.BrokerProcessOptions{Bin: brokerBin, ExchangeAddress: addrs[0], AgentAddress: addrs[1], MetricsAddress: addrs[2],
			Args: []string{"--rate-limit=1000000", "--rate-burst=1000000",
				// The audit lines, one per exchange, go to a rotated file
				// rather than into this process's copy of the output.
				"--audit-log-path=" + filepath.Join(t.TempDir(), "audit.log"), "--audit-log-max-size=10", "--audit-log-max-backups=1"}},
		agentMetrics: addrs[3],
	}
	f.agentOpts = framework.AgentProcessOptions{Bin: agentBin, BrokerAddresses: []string{f.brokerOpts.AgentAddress},
		Args: []string{"--metrics-address=" + f.agentMetrics}}
	var err error
	f.broker, err = deployment.StartBrokerProcess(f.brokerOpts)
	require.NoError(t, err)
	t.Cleanup(func() { f.broker.Stop() })
	f.agent, err = deployment.StartAgentProcess(t.Context(), spoke1, f.agentOpts)
	require.NoError(t, err)
	t.Cleanup(func() { f.agent.Stop() })
	client, conn, err := deployment.ExchangeClient(f.brokerOpts.ExchangeAddress)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	f.client = client
	waitFor(t, time.Minute, "the broker process to be ready", func(c assert.TestingT) { assertReady(c, f.brokerOpts.MetricsAddress) }, f.broker)
	waitFor(t, time.Minute, "the agent process to connect", func(c assert.TestingT) {
		assert.Equal(c, 1.0, f.brokerMetric(t, "credbroker_connected_clusters"), "the broker process's credbroker_connected_clusters (-1: no scrape)")
	}, f.broker, f.agent)
	return f
}

func ready(addr string) bool {
	code, _, err := get("http://" + addr + "/readyz")
	return err == nil && code == http.StatusOK
}

// assertReady states what ready does: addr's /readyz answers 200.
func assertReady(c assert.TestingT, addr string) bool {
	code, body, err := get("http://" + addr + "/readyz")
	return assert.NoError(c, err, "GET %s/readyz", addr) &&
		assert.Equal(c, http.StatusOK, code, "GET %s/readyz: %s", addr, body)
}

func (f *procFleet) brokerMetric(t *testing.T, name string) float64 {
	t.Helper()
	m, err := framework.ScrapeMetrics(t.Context(), f.brokerOpts.MetricsAddress)
	if err != nil {
		return -1
	}
	return m.Sum(name)
}

// usage is what a process's /metrics tell of its resources.
type usage struct {
	Goroutines float64
	// RSS is process_resident_memory_bytes.
	RSS float64
	// HeapGoal is go_memstats_next_gc_bytes: the heap size at which the
	// next GC starts, (1+GOGC/100) times the heap that the last GC found
	// live. It moves with the live heap only, not with the garbage since
	// the last GC, as heap_alloc and RSS do.
	HeapGoal float64
}

func (u usage) String() string {
	return fmt.Sprintf("%.0f goroutines, RSS %s, heap goal %s", u.Goroutines, mib(int64(u.RSS)), mib(int64(u.HeapGoal)))
}

// settledUsage scrapes addr a few times over a second and a half, with no
// load running, and returns the least of each figure: a goroutine that is
// just ending or a GC that has not run yet does not count.
func settledUsage(t *testing.T, addr string) usage {
	t.Helper()
	u := usage{Goroutines: 1e18, RSS: 1e18, HeapGoal: 1e18}
	for i := range 4 {
		if i > 0 {
			time.Sleep(500 * time.Millisecond) // spacing the samples, not synchronization
		}
		m, err := framework.ScrapeMetrics(t.Context(), addr)
		require.NoError(t, err)
		u.Goroutines = min(u.Goroutines, m.Sum("go_goroutines"))
		u.RSS = min(u.RSS, m.Sum("process_resident_memory_bytes"))
		u.HeapGoal = min(u.HeapGoal, m.Sum("go_memstats_next_gc_bytes"))
	}
	return u
}

// mixedLoad runs exchanges against a broker in a few loops, each of one
// kind, until stopped, and counts their codes by kind. While paused, the
// loops wait.
type mixedLoad struct {
	wg     sync.WaitGroup
	stop   chan struct{}
	paused atomic.Bool
	// inflight counts the calls that have not seen paused.
	inflight atomic.Int64

	mu    sync.Mutex
	codes map[string]map[codes.Code]int
	calls []call // of the kinds recorded
}

// call is one exchange of a recorded kind.
type call struct {
	kind  string
	start time.Time
	code  codes.Code
}

// errNoCall tells mixedLoad that a loop made no call this time.
var errNoCall = errors.New("no call")

// loop is one kind of exchange: do makes its i-th call.
type loop struct {
	kind   string
	record bool
	do     func(ctx context.Context, i int) error
}

func startLoad(loops ...loop) *mixedLoad {
	l := &mixedLoad{stop: make(chan struct{}), codes: map[string]map[codes.Code]int{}}
	for _, lp := range loops {
		l.wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-l.stop:
					return
				default:
				}
				// Count first, then look: pause sees every call that has
				// not seen it paused.
				l.inflight.Add(1)
				if l.paused.Load() {
					l.inflight.Add(-1)
					time.Sleep(20 * time.Millisecond)
					continue
				}
				ctx, cancel := context.WithTimeout(context.Background(), 2*mintTimeout)
				start := time.Now()
				err := lp.do(ctx, i)
				cancel()
				if errors.Is(err, errNoCall) {
					l.inflight.Add(-1)
					continue
				}
				code := status.Code(err)
				l.mu.Lock()
				if l.codes[lp.kind] == nil {
					l.codes[lp.kind] = map[codes.Code]int{}
				}
				l.codes[lp.kind][code]++
				if lp.record {
					l.calls = append(l.calls, call{kind: lp.kind, start: start, code: code})
				}
				l.mu.Unlock()
				l.inflight.Add(-1)
				if code != codes.OK {
					time.Sleep(10 * time.Millisecond) // a refused call is fast; do not spin
				}
			}
		})
	}
	return l
}

// pause stops new calls and waits for those in flight.
func (l *mixedLoad) pause() {
	l.paused.Store(true)
	for l.inflight.Load() > 0 {
		time.Sleep(10 * time.Millisecond)
	}
}

func (l *mixedLoad) resume() { l.paused.Store(false) }

func (l *mixedLoad) end() {
	close(l.stop)
	l.wg.Wait()
}

// summary is the calls by kind and code, such as "cached: OK 812; refused: PermissionDenied 90".
func (l *mixedLoad) summary() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var kinds []string
	for k := range l.codes {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	var parts []string
	for _, k := range kinds {
		var cs []string
		for c, n := range l.codes[k] {
			cs = append(cs, fmt.Sprintf("%s %d", c, n))
		}
		sort.Strings(cs)
		parts = append(parts, k+": "+strings.Join(cs, ", "))
	}
	return strings.Join(parts, "; ")
}

// durationFromEnv reads a duration from the environment variable name, or
// returns def when it is unset.
func durationFromEnv(t *testing.T, name string, def time.Duration) time.Duration {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	d, err := time.ParseDuration(v)
	require.NoError(t, err, "%s", name)
	return d
}
