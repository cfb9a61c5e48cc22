// Command broker runs the hub side of credbroker: TokenExchange for
// consumers and AgentTunnel for spoke agents.
//
// It runs on the hub, as deploy/hub/broker.yaml deploys it:
//
//	broker --exchange-address=:8443 --agent-address=:8444 --metrics-address=:8080 \
//	  --trust-domain=example.org \
//	  --tls-cert-file=tls.crt --tls-key-file=tls.key \
//	  --svid-cert-file=svid.crt --svid-key-file=svid.key --trust-bundle-file=ca.crt
//
// The flags become a pkg/broker Config (options.go), and the broker runs until
// SIGTERM or SIGINT. Run with -h for the flags; docs/operations.md describes
// them and what to watch.
package main
