// Package metrics holds the Prometheus collectors the broker and the agent
// both expose: their build and the expiry of their X.509-SVID. Every
// collector is made per call, for the caller's per-process registry; nothing
// here is a package global.
//
// Make the collectors with the caller's metric names and register them in
// one call:
//
//	err := metrics.Register(reg,
//		metrics.BuildInfo("credbroker_agent_build_info", "The agent's build..."),
//		metrics.SVIDExpiry("credbroker_agent_svid_expiry_timestamp_seconds", "...", svidSource))
package metrics
