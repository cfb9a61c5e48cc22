package bench

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/credbroker/credbroker/test/framework"
)

// loadResult is what a closed-loop load of a few workers measured.
type loadResult struct {
	calls   int
	elapsed time.Duration
	lat     []time.Duration // sorted
	errs    int
	err     error // the first
}

func (r loadResult) rps() float64 { return float64(r.calls) / r.elapsed.Seconds() }

// q is the latency quantile p (0 < p < 1), nearest rank.
func (r loadResult) q(p float64) time.Duration { return quantile(r.lat, p) }

func quantile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(p*float64(len(sorted))+0.5) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

// load runs workers that each call call in a loop, for warmup and then for
// measure, and records the calls that started and ended within measure.
func load(ctx context.Context, workers int, warmup, measure time.Duration, call func(ctx context.Context, worker int) error) loadResult {
	start := time.Now()
	from, until := start.Add(warmup), start.Add(warmup+measure)
	lats := make([][]time.Duration, workers)
	errs := make([]int, workers)
	firstErr := make([]error, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for ctx.Err() == nil {
				t0 := time.Now()
				if t0.After(until) {
					return
				}
				err := call(ctx, w)
				t1 := time.Now()
				if err != nil {
					errs[w]++
					if firstErr[w] == nil {
						firstErr[w] = err
					}
					continue
				}
				if t0.After(from) && t1.Before(until) {
					lats[w] = append(lats[w], t1.Sub(t0))
				}
			}
		})
	}
	wg.Wait()
	r := loadResult{elapsed: measure}
	for w := range workers {
		r.lat = append(r.lat, lats[w]...)
		r.errs += errs[w]
		if r.err == nil {
			r.err = firstErr[w]
		}
	}
	slices.Sort(r.lat)
	r.calls = len(r.lat)
	return r
}

// sequential calls call n times, one after another, and returns each
// call's parts as call reports them (a call may time several steps).
func sequential(n int, call func(i int) ([]time.Duration, error)) ([][]time.Duration, error) {
	var out [][]time.Duration
	for i := range n {
		parts, err := call(i)
		if err != nil {
			return out, fmt.Errorf("call %d: %w", i, err)
		}
		out = append(out, parts)
	}
	return out, nil
}

// column returns the sorted j-th part of every call.
func column(calls [][]time.Duration, j int) []time.Duration {
	var c []time.Duration
	for _, parts := range calls {
		c = append(c, parts[j])
	}
	slices.Sort(c)
	return c
}

// spokeTokenRequests is the spoke API server's own count of TokenRequests
// it has answered, from its /metrics, read with the admin credential.
func spokeTokenRequests(ctx context.Context) (float64, error) {
	raw, err := spoke.Client.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(ctx)
	if err != nil {
		return 0, fmt.Errorf("scrape the spoke API server: %w", err)
	}
	m, err := framework.ParseMetrics(string(raw))
	if err != nil {
		return 0, err
	}
	return m.Sum("apiserver_request_total", `resource="serviceaccounts"`, `subresource="token"`), nil
}

// brokerMetric sums a metric of the broker process's /metrics.
func brokerMetric(ctx context.Context, metricsAddr, metric string, labels ...string) (float64, error) {
	m, err := framework.ScrapeMetrics(ctx, metricsAddr)
	if err != nil {
		return 0, err
	}
	return m.Sum(metric, labels...), nil
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2f ms", float64(d.Microseconds())/1000) }
