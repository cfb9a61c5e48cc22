// Package e2e tests credbroker end to end on real kube-apiservers: one hub
// and two spokes started by package framework, a broker and agents running
// in-process over real SPIFFE mTLS, and consumers that use the real
// credbroker-plugin binary or the TokenExchange API.
//
// Run it with `make e2e` (or `make test`), which builds the API servers and
// sets KUBEBUILDER_ASSETS. The benchmarks (`make bench`) measure an exchange
// against a direct TokenRequest on the same spoke, in the same run.
package e2e
