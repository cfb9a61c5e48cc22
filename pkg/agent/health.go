package agent

import (
	"context"
	"errors"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/credbroker/credbroker/internal/probe"
)

// countServing is the Serving callback of the tunnel clients of a broker
// target.
func (a *Agent) countServing(target string, up bool) {
	d := 1
	if !up {
		d = -1
	}
	a.serving.Add(int64(d))
	a.metrics.streams.Add(float64(d))
	a.metrics.targetStreams.WithLabelValues(target).Add(float64(d))
}

// Ready reports nil while the agent can serve, or why not: at least one
// broker stream serves (admitted, neither draining nor leaving), and its
// SVID is valid by Config.Clock. /readyz answers it.
func (a *Agent) Ready() error {
	return probe.All(
		probe.SVIDValid(a.svid, a.clock, 0),
		func() error {
			if a.serving.Load() <= 0 {
				return errors.New("no broker stream serves")
			}
			return nil
		},
	)()
}

// serveMetrics serves /metrics, /healthz and /readyz on the metrics
// listener, and returns the func that stops it.
func (a *Agent) serveMetrics() (stop func()) {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(a.registry, promhttp.HandlerOpts{}))
	probe.Serve(mux, probe.All(), a.Ready)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(a.metricsLis); err != nil && !errors.Is(err, http.ErrServerClosed) {
			a.cfg.Log.Error(err, "metrics server stopped")
		}
	}()
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
		<-done
	}
}

// MetricsAddr is the bound address of the metrics listener; empty when it
// is disabled.
func (a *Agent) MetricsAddr() string {
	if a.metricsLis == nil {
		return ""
	}
	return a.metricsLis.Addr().String()
}
