// Package client is credbroker's Go client for controllers on the hub: it
// trades the controller's hub ServiceAccount token (audience "credbroker")
// for short-lived spoke tokens through the broker, and builds rest.Configs
// that carry them, without exec'ing a plugin.
//
//	tokens, err := client.NewFileTokenSource("/var/run/secrets/credbroker/token", 0, nil)
//	c, err := client.New(client.Config{
//		Address:     "credbroker.credbroker-system.svc:8443",
//		TLS:         &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12},
//		TokenSource: tokens,
//	})
//	defer c.Close()
//	cfg, err := c.RESTConfigFor(ctx, "fleet", "prod-eu-1")
//	cl, err := ctrlclient.New(cfg, ctrlclient.Options{})
//
// # Tokens
//
// A rest.Config from RESTConfigFor holds no token: its Host and CAData are
// the server and CA the broker answers for the ClusterProfile, and its
// WrapTransport sets "Authorization: Bearer" on each request from the
// Client's token cache for that ClusterProfile. Every config and client of
// one ClusterProfile share that cache. A token is used until half its
// lifetime has passed on Config.Clock, then fetched again; after a 401
// from the spoke it is dropped, and the request is sent once more with a
// new token. A config sends a token only to the server and CA it was built
// with; an answer without a server is refused.
//
// FileTokenSource reads the projected hub token again when the kubelet
// rotates the file, after its reread interval, and once the token it holds
// is past its exp claim.
//
// A fetch that the broker's per-consumer rate limit refuses
// (ResourceExhausted with a "retry-after" trailer) waits as told, plus up to
// a fifth more so that callers refused together spread out, and asks again,
// for Config.MaxRetryWait in all (2 minutes by default): a controller that
// starts with more ClusterProfiles than the broker's burst allows is slowed
// down, not failed.
//
// Errors name the ClusterProfile and the broker's gRPC code (errdefs.Code,
// errors.Is with the errdefs sentinels); they never hold a token.
package client
