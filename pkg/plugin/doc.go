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
// form (IPv6 without brackets), a missing port as 443, and the path without
// trailing slashes; a URL with user information, a query, a fragment or an
// IPv6 zone matches nothing, and so does one that is not https, from either
// side: client-go sends the bearer token over http too, in cleartext.
// On a mismatch, or when the broker reports no server, GetToken returns an
// error naming both URLs (errdefs.ErrPermissionDenied), and the binary
// exits 1 with nothing on stdout.
//
// The right URL is not enough: the same status writer could give profile
// X the real server with a CA of theirs, or no verification, or a proxy of
// theirs, and whoever sits on the path (DNS, the network, the proxy) reads
// the token. So the rest of spec.cluster that decides where the token goes
// is checked too, and each mismatch is refused with
// errdefs.ErrPermissionDenied, naming every setting at fault:
//
//   - certificate-authority-data must be the CA bundle the broker reports
//     for the ClusterProfile, byte for byte once surrounding white space is
//     trimmed. When the broker reports none, the exec info must carry none:
//     both then trust the system roots. A bundle on one side only is a
//     mismatch, since the system roots are not the cluster's CA and a CA
//     the cluster does not have is someone else's. A CA given by file
//     (certificate-authority) reaches the plugin as data, while the broker
//     ignores such paths, so it never matches: give the CA as data. Errors
//     name bundles by size and SHA-256, never by content. The bundles are
//     compared as bytes, not parsed: the broker and client-go both read
//     them from the same ClusterProfile field, so an honest pair is equal.
//   - server must be an https URL.
//   - insecure-skip-tls-verify must be false.
//   - proxy-url must be empty. The broker reports no proxy for a cluster,
//     so there is nothing to check a proxy against, and a proxy of the
//     attacker's sits on the token's path: with an http server it reads
//     the token, and over TLS it needs only one more weakness (a CA that
//     signs other names too) to read it, while it sees where and when the
//     token is used in any case. Spokes reached through a proxy are not
//     supported by the pin yet; the broker would have to report the proxy
//     from the ClusterProfile. A proxy from the consumer's own environment
//     (HTTPS_PROXY) is not in the exec info and is not the status writer's
//     to choose.
//   - tls-server-name must be empty or the server URL's host (case aside,
//     an IP address in any spelling), which is what the client verifies
//     anyway. The broker reports no TLS server name, and another name
//     lets the client accept any certificate the cluster's CA issued for
//     that name: a CA shared by several clusters, or a cluster CA that also
//     signs other serving certificates (kubelets'), would hand the token to
//     whoever holds one of those. Refusing costs little, as access
//     providers rarely need a TLS server name, and they can be supported
//     when the broker reports one.
//
// The server's scheme, insecure-skip-tls-verify, proxy-url and
// tls-server-name are checked before the exchange, so they cost no mint; the CA, like the server, only
// after it, since the broker answers the cluster's with the token.
//
// When the ExecCredential carries no server (provideClusterInfo: false, or
// a Go caller that passes none), there is nothing to compare, and GetToken
// refuses before it asks for a token (errdefs.ErrFailedPrecondition), even
// when [Config.Cluster] names the ClusterProfile: the plugin cannot know
// where client-go will send the token, and the exec config must set
// provideClusterInfo: true in any case. A Go caller that uses the token
// itself passes the server it will use in spec.cluster.server.
//
// # Waiting out the broker's rate limit
//
// The broker limits what each consumer may cost the hub and the spokes
// (--rate-limit, --rate-burst), and refuses a call over the limit with
// ResourceExhausted and a "retry-after" trailer: whole seconds, usually
// one. client-go treats a failed exec plugin as a failed request, so the
// plugin waits as told, plus up to a fifth more so that plugins refused
// together do not all come back at once, and asks again, as package
// client does (both through brokerclient.WaitAndRetry). A refusal
// without a retry-after, and any other error, is returned at once.
//
// The waits are bounded by [Config.MaxRetryWait], [DefaultMaxRetryWait]
// (30s) unless set, and each exchange by [Config.Timeout] (30s, --timeout),
// so one GetToken lasts at most Timeout plus MaxRetryWait: a minute with
// the defaults. client-go runs the plugin synchronously, holding up the
// request that needed the token, and kubectl's user waits for it; a
// minute is as long as a person waits for a command before giving up, and
// much more than a consumer within its limit is ever told to wait (a
// second at the default 20 per second). A wait that would not fit is not
// begun: the refusal is returned at once, naming the wait, so a caller
// that runs the plugin again later fares no worse. Retries send the
// hub token read for the GetToken; the kubelet renews it well before it
// expires.
//
// The hub token file is read again on every GetToken, since the kubelet
// rotates it, and is sent only as gRPC per-RPC credentials that require a
// secure transport. No error returned here ever contains a token.
//
// [credentialplugin.Provider]: https://pkg.go.dev/sigs.k8s.io/cluster-inventory-api/pkg/credentialplugin#Provider
package plugin
