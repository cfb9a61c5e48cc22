package broker

import (
	"time"

	"google.golang.org/grpc"
)

// drain stops the broker within ShutdownGrace: not ready and NOT_SERVING on
// both gRPC ports at once, agents told; new calls are still served for
// ShutdownDelay, then refused (a consumer retries another replica) while
// the exchanges in flight finish with their mints; then the agent streams
// close.
func (b *Broker) drain(exchange, agents *grpc.Server) {
	start := time.Now()
	deadline := start.Add(b.cfg.ShutdownGrace)
	b.draining.Store(true)
	b.health.Shutdown()
	b.tunnel.Drain()
	b.log.Info("broker draining", "grace", b.cfg.ShutdownGrace.String(), "delay", b.cfg.ShutdownDelay.String())
	time.Sleep(b.cfg.ShutdownDelay)
	if b.proxyServer != nil {
		// Before the agent streams close: a consumer's next request goes
		// to another replica, not to one that has no agent left. Watches
		// and upgraded connections are cut after half the time left.
		b.stopProxy(time.Until(deadline) / 2)
	}
	stopGracefully(exchange, time.Until(deadline))
	b.tunnel.Close()
	stopGracefully(agents, time.Until(deadline))
	b.log.Info("broker drained", "took", time.Since(start).Round(time.Millisecond).String())
}

// stopGracefully lets in-flight calls finish for up to grace, then stops
// hard.
func stopGracefully(s *grpc.Server, grace time.Duration) {
	done := make(chan struct{})
	go func() {
		s.GracefulStop()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(grace):
		s.Stop()
	}
}
