// Package probe builds the /healthz and /readyz endpoints that the broker
// and the agent serve: a list of checks, each nil when satisfied, the first
// failure answered as 503 with its reason. Checks read the clock they are
// given, so tests step a fake one.
//
//	ready := probe.All(probe.Synced("informer not synced", inf.HasSynced), probe.SVIDValid(src, clk, probe.MinSVIDLifetime), probe.NotDraining(&draining))
//	probe.Serve(mux, probe.All(), ready)
package probe
