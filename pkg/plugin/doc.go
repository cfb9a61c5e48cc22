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
// # The token goes only to the cluster's server
//
// client-go sends the token to ExecCredential spec.cluster.server, which
// comes from the same ClusterProfile status as the exec config, and whoever
// may write that status could point one profile's access provider at a
// server of theirs while its exec config names another ClusterProfile. So
// GetToken compares spec.cluster.server with the server the broker reports
// for the ClusterProfile it got the token for, and returns the token only
// when they are the same server. Spelling aside, they must match exactly:
// scheme and host are compared without case, an IP address in its canonical
// form (IPv6 without brackets), a missing port as the scheme's default
// (https 443, http 80), and the path without trailing slashes; a URL with
// user information, a query, a fragment or an IPv6 zone matches nothing.
// On a mismatch, or when the broker reports no server, GetToken returns an
// error naming both URLs (errdefs.ErrPermissionDenied), and the binary
// exits 1 with nothing on stdout.
//
// When the ExecCredential carries no server (provideClusterInfo: false, or
// a Go caller that passes none), there is nothing to compare, and GetToken
// refuses before it asks for a token (errdefs.ErrFailedPrecondition), even
// when [Config.Cluster] names the ClusterProfile: the plugin cannot know
// where client-go will send the token, and the exec config must set
// provideClusterInfo: true in any case. A Go caller that uses the token
// itself passes the server it will use in spec.cluster.server.
//
// The hub token file is read again on every GetToken, since the kubelet
// rotates it, and is sent only as gRPC per-RPC credentials that require a
// secure transport. No error returned here ever contains a token.
//
// [credentialplugin.Provider]: https://pkg.go.dev/sigs.k8s.io/cluster-inventory-api/pkg/credentialplugin#Provider
package plugin
