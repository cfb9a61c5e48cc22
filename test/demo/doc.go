// Command demo is the program behind `make demo`: it tells, step by step, how
// consumers on a hub cluster get short-lived tokens for spoke clusters from
// credbroker, and use them.
//
// It starts a hub and two spoke kube-apiservers (each with its own etcd)
// with package framework, and then runs credbroker as a user would, as
// separate processes with the flags a user would pass: bin/broker against
// the hub, as the ServiceAccount and with the RBAC of deploy/hub/rbac.yaml
// and deploy/components/publish-access-provider (applied with kubectl), with
// --publish-access-provider; and one bin/spoke-agent per spoke, as the
// ServiceAccount and with the RBAC of deploy/spoke/rbac.yaml, which dials
// out to the broker over SPIFFE mTLS and advertises its spoke with
// --advertise-server and --advertise-ca-file. The hub's ClusterProfiles
// start with no access provider: the broker publishes them once the agents
// connect.
//
// On the hub it creates the consumer argocd/application-controller, allowed
// by RBAC to create clusterprofiles/token for both spokes; on each spoke,
// team-a/deployer, which opts in to that consumer with the
// credbroker.io/allowed-subjects annotation. Then it lists the namespaces of
// both spokes in three ways: through cluster-inventory-api's pkg/access
// (access.BuildConfigFromCP with a provider file naming credbroker-plugin),
// through the Go client pkg/client (RESTConfigFor), and with kubectl and a
// kubeconfig that `credbroker kubeconfig` writes. It times an exchange
// against a direct TokenRequest, shows a refusal, traces a request in the
// spoke's audit log back to the hub consumer and revokes that token with the
// credbroker CLI, and checks that the hub stores no spoke token and that no
// log holds one. It never prints a token, only its fingerprint or
// credential id.
//
// Run it with
//
//	make demo
//
// which builds the API servers, kubectl and bin/ and then runs
//
//	KUBEBUILDER_ASSETS=<folder of kube-apiserver, etcd and kubectl> go run ./test/demo \
//	  --plugin=bin/credbroker-plugin --cli=bin/credbroker --broker=bin/broker --agent=bin/spoke-agent
//
// from the repository's root (--deploy names the deploy folder otherwise).
// With --keep, it waits for Ctrl-C after the story and prints admin
// kubeconfigs for the hub and the spokes, to look around with kubectl.
// Everything it started is stopped (the agents and the broker with SIGTERM)
// and its temporary folder removed when it exits, Ctrl-C included. It exits
// with 1 when a step fails, and with 130 when interrupted.
//
// TestDemo runs the same story in `make test`, on binaries built as
// `make build` builds them, and fails when a step fails or shows nothing.
package main
