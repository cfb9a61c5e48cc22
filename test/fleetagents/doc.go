// Command fleetagents simulates the agents of a fleet in one process, for the
// start-up test of test/e2e (TestFleetStartsAllAtOnce): one agent per SVID
// in --svid-dir, each on its own SPIFFE mTLS connection to the broker, as
// a real agent holds. The agents answer every mint with a made-up token,
// shaped like a spoke ServiceAccount token, without a spoke API server: what
// the test puts under load is the broker (its rate limit, its caches and its
// agent streams), not TokenRequest.
//
// It runs outside the race-enabled test binary because a thousand gRPC
// connections, with both of their ends in one process, would exceed the race
// detector's limit of 8,128 live goroutines.
//
// Files: --svid-dir holds <name>.crt and <name>.key pairs. Once every agent
// is admitted it prints "admitted <n>" on stdout; it stops when stdin closes
// and then prints "mints <n>", the mints it answered.
//
// An agent whose stream ends (the broker restarted, say) connects again as
// pkg/tunnel's client does: over a new connection, after a wait jittered
// between half and all of a backoff that starts at 500ms and doubles up to
// 30s, and is reset by an admission. The broker-restart scenario of
// test/bench (make bench-fleet) counts the streams back on the broker.
// Thousands of agents fit: the process needs a file descriptor per agent.
package main
