// Command credbroker-plugin is a client-go exec credential plugin that gets
// a short-lived spoke token from the credbroker broker, in exchange for the
// pod's projected hub ServiceAccount token (audience "credbroker").
//
// It reads ExecCredential from KUBERNETES_EXEC_INFO, so the exec config must
// set provideClusterInfo: true; the ClusterProfile to ask for comes from
// spec.cluster.config (see package plugin) or from --cluster.
//
// The token is printed only when spec.cluster.server, where client-go will
// send it, is the server the broker reports for that ClusterProfile, and
// spec.cluster.certificate-authority-data its CA bundle, with no
// insecure-skip-tls-verify, no proxy-url and no tls-server-name other than
// the server's host (see package plugin).
//
// Each flag takes one value: a flag given again with another value is a bad
// flag, so that a ClusterProfile's additional-args, which cluster-inventory-api
// appends to the provider file's args under profileSourcedCLIArgsPolicy:
// Append, cannot send the hub token to another broker address, CA or token
// file. The same value again is taken. Several audiences go in one
// comma-separated --audience.
//
// A refusal by the broker's per-consumer rate limit that says how long to
// wait (retry-after) is waited out, plus up to a fifth more, and asked
// again, for 30s of waiting in all; --timeout bounds each request, so one
// run lasts at most --timeout plus 30s (see package plugin).
//
// Exit status: 0 with an ExecCredential on stdout; 1 when no token could be
// had, or it was refused for another server, CA or transport; 2 for bad
// flags. Errors go to
// stderr as "[credbroker] <message>".
//
// A cluster-inventory-api provider file entry:
//
//	{"providers": [{
//	  "name": "credbroker",
//	  "execConfig": {
//	    "apiVersion": "client.authentication.k8s.io/v1",
//	    "command": "/usr/local/bin/credbroker-plugin",
//	    "args": ["--broker-address=credbroker.credbroker-system.svc:8443",
//	             "--ca-file=/etc/credbroker/ca.pem"],
//	    "provideClusterInfo": true,
//	    "interactiveMode": "Never"
//	  }
//	}]}
//
// Run with -h for the flags.
package main
