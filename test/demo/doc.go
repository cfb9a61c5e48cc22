// Command demo is the program behind `make demo`: it tells, step by step, how
// a consumer on a hub cluster gets a short-lived token for a spoke cluster
// from credbroker, and uses it.
//
// It starts everything on this machine, with package framework: a hub and
// one spoke kube-apiserver (each with its own etcd), the broker against the
// hub, and the agent on the spoke, which dials out to the broker over
// SPIFFE mTLS. On the hub it creates the consumer argocd/application-controller,
// allowed by RBAC to create clusterprofiles/token for fleet/spoke-1; on the
// spoke, team-a/deployer, which opts in to that consumer with the
// credbroker.io/allowed-subjects annotation. Then it does what a consumer
// pod does: it writes its audience-bound hub token to a file, names the
// credbroker-plugin binary in a cluster-inventory-api provider file, builds a
// rest.Config from the hub's ClusterProfile with access.BuildConfigFromCP, and
// lists the spoke's namespaces with it. It times an exchange against a direct
// TokenRequest, shows a refusal, and checks that the hub stores no spoke
// token. It never prints a token, only its fingerprint or credential id.
//
// Run it with
//
//	make demo
//
// which builds the API servers and bin/credbroker-plugin and then runs
//
//	KUBEBUILDER_ASSETS=<folder of kube-apiserver and etcd> go run ./test/demo --plugin bin/credbroker-plugin
//
// With --keep, it waits for Ctrl-C after the story and prints admin
// kubeconfigs for the hub and the spoke, to look around with kubectl.
// Everything it started is stopped and its temporary folder removed when it
// exits, Ctrl-C included. It exits with 1 when a step fails, and with 130
// when interrupted.
package main
