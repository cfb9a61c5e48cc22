// Command spoke-agent runs the spoke side of credbroker: it holds a stream to
// every broker replica and mints ServiceAccount tokens under the spoke's
// policy.
//
// It runs on each spoke, as deploy/spoke/agent.yaml deploys it:
//
//	spoke-agent --cluster=fleet/spoke-1 --broker-address=broker.example:8444 \
//	  --broker-spiffe-id=spiffe://example.org/broker --trust-domain=example.org \
//	  --svid-cert-file=svid.crt --svid-key-file=svid.key --trust-bundle-file=ca.crt
//
// The flags become a pkg/agent Config (options.go), and the agent runs until
// SIGTERM or SIGINT. Run with -h for the flags; docs/operations.md describes
// them and what to watch.
package main
