package framework_test

import (
	"context"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"github.com/spiffe/go-spiffe/v2/workloadapi"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/credbroker/credbroker/test/framework"
)

// startSPIRE starts SPIRE for t, stops it at the end and shows its logs when
// t failed.
func startSPIRE(t *testing.T, ctx context.Context, opts framework.SPIREOptions) *framework.SPIRE {
	t.Helper()
	if testing.Verbose() {
		opts.Log = funcr.New(func(_, args string) { t.Log("framework:", args) }, funcr.Options{})
	}
	s, err := framework.StartSPIRE(ctx, opts)
	require.NoError(t, err)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("SPIRE output:\n%s", s.Output())
		}
		assert.NoError(t, s.Stop())
	})
	return s
}

// svidWatcher records the serial numbers of the X509-SVIDs a Workload API
// socket serves, in order, and every SPIFFE ID it ever served.
type svidWatcher struct {
	mu      sync.Mutex
	serials []string
	ids     map[string]bool
	counts  []int // SVIDs per update
	changed chan struct{}
}

func (w *svidWatcher) OnX509ContextUpdate(c *workloadapi.X509Context) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.counts = append(w.counts, len(c.SVIDs))
	for _, s := range c.SVIDs {
		w.ids[s.ID.String()] = true
	}
	if s := c.DefaultSVID(); s != nil {
		if serial := s.Certificates[0].SerialNumber.String(); len(w.serials) == 0 || w.serials[len(w.serials)-1] != serial {
			w.serials = append(w.serials, serial)
		}
	}
	select {
	case w.changed <- struct{}{}:
	default:
	}
}

func (w *svidWatcher) OnX509ContextWatchError(error) {}

func (w *svidWatcher) snapshot() (serials []string, ids map[string]bool, counts []int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	ids = map[string]bool{}
	for id := range w.ids {
		ids[id] = true
	}
	return append([]string(nil), w.serials...), ids, append([]int(nil), w.counts...)
}

// TestSPIRERotatesWorkloadSVIDs proves the SPIRE harness on its own: a
// server and two agents on loopback, one workload registered on each, each
// agent's Workload API serving only its own workload's SVID, which chains to
// the server's bundle and rotates (new serial) at least twice within a few
// TTLs.
func TestSPIRERotatesWorkloadSVIDs(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	const ttl = 20 * time.Second
	s := startSPIRE(t, ctx, framework.SPIREOptions{X509SVIDTTL: ttl})
	require.Equal(t, framework.TrustDomain, s.TrustDomain.Name())

	ids := map[string]string{ // agent name → workload SPIFFE ID
		"hub":     "spiffe://" + framework.TrustDomain + "/broker",
		"spoke-1": framework.AgentID("spoke-1"),
	}
	agents := map[string]*framework.SPIREAgent{}
	for name, id := range ids {
		a, err := s.StartAgent(ctx, name)
		require.NoError(t, err)
		require.NoError(t, a.RegisterWorkload(ctx, id, os.Getuid()))
		agents[name] = a
	}
	err := agents["hub"].RegisterWorkload(ctx, "spiffe://other.test/broker", os.Getuid())
	require.ErrorContains(t, err, "not in trust domain", "an ID SPIRE could never serve fails at once")

	for name, a := range agents {
		t.Run("served/"+name, func(t *testing.T) {
			x, err := workloadapi.FetchX509Context(ctx, workloadapi.WithAddr(a.Endpoint()))
			require.NoError(t, err)
			require.Len(t, x.SVIDs, 1, "each agent serves exactly the workload registered on it")
			svid := x.SVIDs[0]
			assert.Equal(t, ids[name], svid.ID.String())
			_, _, err = x509svid.Verify(svid.Certificates, x.Bundles)
			require.NoError(t, err, "the SVID chains to the trust domain's bundle")
			leaf := svid.Certificates[0]
			// SPIRE backdates NotBefore by 10s; NotAfter is the TTL from issue.
			assert.LessOrEqual(t, leaf.NotAfter.Sub(leaf.NotBefore), ttl+10*time.Second+time.Second)
			assert.WithinDuration(t, time.Now().Add(ttl), leaf.NotAfter, ttl)
		})
	}

	// Watch both sockets until each has served three serials: two rotations.
	watchers := map[string]*svidWatcher{}
	wctx, wcancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() { wcancel(); wg.Wait() }()
	for name, a := range agents {
		w := &svidWatcher{ids: map[string]bool{}, changed: make(chan struct{}, 1)}
		watchers[name] = w
		wg.Go(func() { _ = workloadapi.WatchX509Context(wctx, w, workloadapi.WithAddr(a.Endpoint())) })
	}
	began := time.Now()
	for name, w := range watchers {
		for {
			serials, _, _ := w.snapshot()
			if len(serials) >= 3 {
				t.Logf("%s: 2 rotations seen after %s", name, time.Since(began).Round(time.Millisecond))
				break
			}
			select {
			case <-w.changed:
			case <-ctx.Done():
				require.FailNow(t, "too few rotations", "%s served serials %v in %s, want 3 (TTL %s)", name, serials, time.Since(began), ttl)
			}
		}
	}
	for name, w := range watchers {
		serials, seen, counts := w.snapshot()
		assert.Equal(t, map[string]bool{ids[name]: true}, seen, "%s only ever served its own workload", name)
		for _, n := range counts {
			assert.Equal(t, 1, n, "%s: SVIDs per update", name)
		}
		assert.Len(t, uniq(serials), len(serials), "%s: a rotated SVID has a new serial", name)
	}
}

// TestSPIREMissingBinaries names `make spire` when the binaries are missing.
func TestSPIREMissingBinaries(t *testing.T) {
	_, err := framework.StartSPIRE(context.Background(), framework.SPIREOptions{BinDir: t.TempDir()})
	require.ErrorIs(t, err, framework.ErrMissingSPIRE)
	assert.Contains(t, err.Error(), "make spire")
}

func uniq(s []string) map[string]bool {
	m := map[string]bool{}
	for _, v := range s {
		m[v] = true
	}
	return m
}
