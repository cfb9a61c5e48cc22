// Package plugin is credbroker's client-go exec credential plugin: a
// [credentialplugin.Provider] that trades the consumer pod's projected hub
// ServiceAccount token (audience "credbroker") for a short-lived spoke token
// by calling the broker's TokenExchange.Exchange over TLS.
//
// The plugin learns which spoke to ask for from the ClusterProfile: the
// access provider named [Name] in the ClusterProfile status carries, in its
// cluster's "client.authentication.k8s.io/exec" extension, an [ExecConfig]
// such as
//
//	{"clusterProfile": {"namespace": "fleet", "name": "prod-eu-1"}}
//
// which client-go hands to the plugin as ExecCredential spec.cluster.config
// when the exec config sets provideClusterInfo: true. [Config.Cluster]
// overrides it (the --cluster flag of cmd/credbroker-plugin).
//
// Typical use, from a main package:
//
//	p, err := plugin.New(plugin.Config{
//		BrokerAddress: "credbroker.credbroker-system.svc:8443",
//		TLS:           &tls.Config{RootCAs: pool},
//		TokenFile:     "/var/run/secrets/credbroker/token",
//	})
//	if err != nil { ... }
//	credentialplugin.Run(p)
//
// The hub token file is read again on every GetToken, since the kubelet
// rotates it, and is sent only as gRPC per-RPC credentials that require a
// secure transport. No error returned here ever contains a token.
//
// [credentialplugin.Provider]: https://pkg.go.dev/sigs.k8s.io/cluster-inventory-api/pkg/credentialplugin#Provider
package plugin
