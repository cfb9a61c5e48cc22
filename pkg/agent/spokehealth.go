package agent

import (
	"context"
	"strings"
	"time"

	"k8s.io/client-go/rest"

	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/tunnel"
)

// maxSpokeHealthMessage bounds the reason the agent reports for a spoke
// that is not ready, in bytes; the broker clips it again.
const maxSpokeHealthMessage = 400

// probeSpoke asks the spoke API server's /readyz every SpokeHealthInterval
// until ctx ends, and reports it to the broker streams through health:
// ready after one answer of 200 OK, and not ready after
// SpokeHealthFailureThreshold failures in a row, so that one slow answer
// does not make the hub's controllers leave the cluster.
func (a *Agent) probeSpoke(ctx context.Context, spoke rest.Interface, health *tunnel.SpokeHealth) error {
	ticker := a.clock.NewTicker(a.cfg.SpokeHealthInterval)
	defer ticker.Stop()
	j := judge{threshold: a.cfg.SpokeHealthFailureThreshold}
	for {
		msg := readyz(ctx, spoke, min(a.cfg.SpokeHealthInterval, 10*time.Second))
		if ctx.Err() != nil {
			return nil
		}
		if ready, report := j.observe(msg); report {
			gauge := 0.0
			if ready {
				gauge = 1
			} else if j.failures == j.threshold {
				a.cfg.Log.Info("spoke API server not ready", "failures", j.failures, fleet.LogReason, msg)
			}
			health.Set(ready, msg)
			a.metrics.spokeReady.Set(gauge)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-ticker.C():
		}
	}
}

// judge turns probe results into reports: ready after one success, and
// not ready once threshold failures come in a row.
type judge struct {
	threshold, failures int
}

// observe takes one probe's result, "" for a success, and returns the
// readiness to report, if any.
func (j *judge) observe(msg string) (ready, report bool) {
	if msg == "" {
		j.failures = 0
		return true, true
	}
	j.failures++
	return false, j.failures >= j.threshold
}

// readyz asks the spoke API server's /readyz, and returns "" when it
// answers 200 OK, and else why not: the checks it names as failed, or the
// error.
func readyz(ctx context.Context, spoke rest.Interface, timeout time.Duration) string {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	body, err := spoke.Get().AbsPath("/readyz").DoRaw(ctx)
	if err == nil {
		return ""
	}
	var failed []string
	for line := range strings.Lines(string(body)) {
		if strings.HasPrefix(line, "[-]") {
			failed = append(failed, strings.TrimSpace(line))
		}
	}
	msg := "/readyz: " + err.Error()
	if len(failed) > 0 {
		msg = "/readyz reports " + strings.Join(failed, "; ")
	}
	if len(msg) > maxSpokeHealthMessage {
		msg = strings.ToValidUTF8(msg[:maxSpokeHealthMessage], "") + "..."
	}
	return msg
}
