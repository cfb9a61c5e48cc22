// Package agent assembles the spoke side of credbroker: a ServiceAccount
// informer, the policy-checking Minter of package spoke, and one tunnel
// client per broker replica: a broker address that is a DNS name, such as a
// headless Service, is re-resolved and the agent keeps a stream to every
// address it resolves to.
//
//	a, err := agent.New(cfg)
//	if err != nil { ... }
//	err = a.Run(ctx) // until ctx ends; the first failing part stops the rest
//
// The agent knows nothing of consumers or of the hub inventory: it sees only
// the mint requests that arrive on its streams, and mints only what the
// spoke's own ServiceAccount annotations allow. cmd/spoke-agent is a thin
// flag parser over this package.
package agent
