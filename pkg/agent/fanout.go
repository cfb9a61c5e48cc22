package agent

import (
	"context"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/go-logr/logr"

	"github.com/credbroker/credbroker/pkg/fleet"
)

// fanout keeps one stream to every address a broker target resolves to, so
// that any broker replica behind a headless Service can reach this agent.
// An IP target is a single address and is never re-resolved.
type fanout struct {
	target   string // host:port
	lookup   func(ctx context.Context, host string) ([]string, error)
	interval time.Duration
	// serve runs one stream to addr until ctx ends; connected is called once
	// the broker admits it.
	serve func(ctx context.Context, addr string, connected func()) error
	log   logr.Logger
	// onStreams, when set, is told how many streams the target wants (the
	// addresses it resolves to) after each resolution.
	onStreams func(float64)

	// soon is resolveSoon's signal to Run.
	soon chan struct{}

	once      sync.Once
	connected chan struct{} // closed when the first stream is admitted
	// onConnected, when set, is called once, when connected is closed.
	onConnected func()
}

// markConnected closes connected, and calls onConnected, the first time.
func (f *fanout) markConnected() {
	f.once.Do(func() {
		close(f.connected)
		if f.onConnected != nil {
			f.onConnected()
		}
	})
}

func newFanout(target string, interval time.Duration, lookup func(context.Context, string) ([]string, error),
	serve func(context.Context, string, func()) error, log logr.Logger) *fanout {
	return &fanout{target: target, lookup: lookup, interval: interval, serve: serve, log: log.WithValues("target", target),
		connected: make(chan struct{}), soon: make(chan struct{}, 1)}
}

// fastResolve is how often the target is resolved for an interval after
// resolveSoon.
const fastResolve = time.Second

// resolveSoon has Run resolve the target now, and every fastResolve for one
// interval, such as after a replica said it drains: its replacement comes
// at another address, and should not wait for the next interval to be
// found. It does not block.
func (f *fanout) resolveSoon() {
	select {
	case f.soon <- struct{}{}:
	default:
	}
}

// Run resolves the target every interval and starts or stops streams to
// match, until ctx ends. A failed lookup keeps the streams it has.
func (f *fanout) Run(ctx context.Context) error {
	host, port, err := net.SplitHostPort(f.target)
	if err != nil {
		return err
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	running := map[string]context.CancelFunc{}
	defer func() {
		for _, cancel := range running {
			cancel()
		}
	}()
	start := func(addr string) {
		sctx, cancel := context.WithCancel(ctx)
		running[addr] = cancel
		wg.Go(func() {
			if err := f.serve(sctx, addr, f.markConnected); err != nil {
				f.log.Error(err, "broker stream stopped", fleet.LogAddress, addr)
			}
		})
	}

	if net.ParseIP(host) != nil {
		f.report(1)
		start(f.target)
		<-ctx.Done()
		return nil
	}
	var fastUntil time.Time
	for {
		ips, err := f.lookup(ctx, host)
		if err != nil || len(ips) == 0 {
			f.log.Info("cannot resolve broker; keeping current streams", fleet.LogErr, lookupFailure(err), "streams", len(running))
		} else {
			want := make([]string, 0, len(ips))
			for _, ip := range ips {
				want = append(want, net.JoinHostPort(ip, port))
			}
			for addr, cancel := range running {
				if !slices.Contains(want, addr) {
					f.log.Info("broker replica gone; closing its stream", fleet.LogAddress, addr)
					cancel()
					delete(running, addr)
				}
			}
			for _, addr := range want {
				if _, ok := running[addr]; !ok {
					f.log.Info("broker replica found; opening a stream", fleet.LogAddress, addr)
					start(addr)
				}
			}
		}
		f.report(len(running))
		wait := f.interval
		if time.Now().Before(fastUntil) {
			wait = min(fastResolve, f.interval)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		case <-f.soon:
			fastUntil = time.Now().Add(f.interval)
		}
	}
}

func (f *fanout) report(n int) {
	if f.onStreams != nil {
		f.onStreams(float64(n))
	}
}

func lookupFailure(err error) string {
	if err == nil {
		return "no addresses"
	}
	return err.Error()
}
