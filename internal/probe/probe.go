package probe

import (
	"errors"
	"fmt"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"k8s.io/utils/clock"
)

// MinSVIDLifetime is how long the SVID must stay valid for the process to be
// ready: a process whose SVID is about to expire (its source stopped
// rotating it) leaves the Service before its peers refuse it. An SVID whose
// whole lifetime is under four times as long needs only a quarter of its
// lifetime left: its source rotates it at half life, and a process with a
// two-minute SVID must not flap.
const MinSVIDLifetime = time.Minute

// Check returns nil when its condition holds, or why it does not.
type Check func() error

// All is satisfied when every check is; it returns the first failure.
func All(checks ...Check) Check {
	return func() error {
		for _, c := range checks {
			if err := c(); err != nil {
				return err
			}
		}
		return nil
	}
}

// Synced holds once fn reports true; otherwise it fails with what.
func Synced(what string, fn func() bool) Check {
	return func() error {
		if !fn() {
			return errors.New(what)
		}
		return nil
	}
}

// NotDraining holds until draining is set.
func NotDraining(draining *atomic.Bool) Check {
	return func() error {
		if draining.Load() {
			return errors.New("draining: the process is shutting down")
		}
		return nil
	}
}

// SVIDValid holds while the SVID of src (every certificate of its chain)
// stays valid for more than min by clk, or than a quarter of the leaf's
// lifetime when that is less.
func SVIDValid(src x509svid.Source, clk clock.PassiveClock, min time.Duration) Check {
	return func() error {
		svid, err := src.GetX509SVID()
		if err != nil {
			return fmt.Errorf("no SVID: %w", err)
		}
		if len(svid.Certificates) == 0 {
			return errors.New("no SVID: the source holds no certificate")
		}
		notAfter := svid.Certificates[0].NotAfter
		for _, c := range svid.Certificates[1:] {
			if c.NotAfter.Before(notAfter) {
				notAfter = c.NotAfter
			}
		}
		leaf := svid.Certificates[0]
		if life := leaf.NotAfter.Sub(leaf.NotBefore); life > 0 && life/4 < min {
			min = life / 4
		}
		if notAfter.Sub(clk.Now()) <= min {
			return fmt.Errorf("the SVID %s expires at %s, in %s or less", svid.ID, notAfter.UTC().Format(time.RFC3339), min)
		}
		return nil
	}
}

// Serve adds /healthz, answered by alive, and /readyz, answered by ready, to
// mux: 200 "ok", or 503 with the reason of the failing check.
func Serve(mux *http.ServeMux, alive, ready Check) {
	handler := func(check Check) http.HandlerFunc {
		return func(w http.ResponseWriter, _ *http.Request) {
			if err := check(); err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
			_, _ = w.Write([]byte("ok"))
		}
	}
	mux.HandleFunc("/healthz", handler(alive))
	mux.HandleFunc("/readyz", handler(ready))
}
