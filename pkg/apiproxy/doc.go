// Package apiproxy is credbroker's data path: it carries consumers'
// requests to spoke API servers that the hub cannot reach, through the
// agents, on apiserver-network-proxy (konnectivity).
//
// On the broker, a Router serves konnectivity's AgentService on the agent
// port. It admits each stream as the AgentTunnel admits its own (an
// Admitter, *tunnel.Server), keeps one konnectivity proxy server per
// ClusterProfile incarnation, which only that ClusterProfile's agents join,
// and Dial opens a TCP connection to a ClusterProfile's API server through
// one of them. A Proxy is the HTTPS handler in front: it serves
// /clusters/<namespace>/<name>/… and forwards a request only with a live
// token that credbroker minted for that ClusterProfile (Grants), to the API
// server verified as the ClusterProfile's status records it (Upstreams,
// from the DataPathExtensionName extension); everything else gets a 401
// Status and is not forwarded.
//
//	router, err := apiproxy.NewRouter(apiproxy.RouterConfig{Admitter: tunnelServer, ServerID: id})
//	agentpb.RegisterAgentServiceServer(agentGRPCServer, router)
//	go router.Run(ctx)
//	proxy, err := apiproxy.NewProxy(apiproxy.ProxyConfig{Dialer: router, Grants: registry, Upstreams: upstreams})
//	http.Server{Handler: proxy, TLSConfig: serving}.ServeTLS(lis, "", "")
//
// On the spoke, a Backend runs a konnectivity agent to each broker address
// and connects every dial to the spoke API server, whatever address the
// broker names: only APIServerAddress is dialled, as APIServer.
package apiproxy
