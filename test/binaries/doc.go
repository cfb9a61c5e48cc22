// Package binaries runs the shipped binaries as an operator would: it
// builds bin/broker and bin/spoke-agent from this tree with the Makefile's
// version ldflags, applies the ServiceAccounts, RBAC and spoke admission
// policies rendered from deploy/hub and deploy/spoke (kubectl kustomize) to
// a real hub and spoke (test/framework), and starts the broker and an agent
// as processes that authenticate as those ServiceAccounts. No broker runs
// in the test process.
//
// The tests go through the processes: the exchange, the refusals, a cached
// exchange, revocation, the health and metrics endpoints, the default
// per-consumer rate limit (with a lowered --rate-burst), --version, and
// that no token is stored on the hub or written by a process. After the
// whole suite, TestMain compares what deploy/ grants each ServiceAccount
// with what the processes did, from the API servers' audit logs: a
// permission that no test used, or a request refused with 403, fails the
// suite.
package binaries
