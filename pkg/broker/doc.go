// Package broker assembles the hub side of credbroker: the TokenExchange
// service for consumers, the AgentTunnel service for spoke agents, the
// ClusterProfile informer that joins them, and the metrics and health
// endpoints.
//
//	b, err := broker.New(cfg)
//	if err != nil { ... }
//	err = b.Run(ctx) // until ctx ends; the first failing part stops the rest
//
// New binds the listeners, so the addresses are known (and ports taken)
// before Run starts serving. cmd/broker is a thin flag parser over this
// package.
package broker
