// Package tunnel carries mint requests from the broker to spoke agents over
// the AgentTunnel.Connect stream, which agents open outbound.
//
// On the broker, a Server accepts streams, maps each agent's SPIFFE ID to one
// ClusterProfile through a Resolver, and keeps a registry of live sessions per
// cluster. Server.Mint sends a request down one live session of a cluster,
// spreading requests over the sessions round robin, and waits for the answer
// that carries the same correlation id, or for its deadline. An agent's
// refusal keeps its code only if it is one an agent may give, and its message
// reaches the consumer without control characters or links, clipped to 1 KiB;
// the agent logs the full text.
//
//	srv, err := tunnel.NewServer(tunnel.ServerConfig{Resolver: r, PeerID: identity.PeerID})
//	credbrokerv1alpha1.RegisterAgentTunnelServer(grpcServer, srv)
//	resp, err := srv.Mint(ctx, cluster, req)
//
// On the spoke, a Client holds one stream to one broker address, reconnects
// with jittered exponential backoff, and hands every mint request to a Minter,
// which the agent wires to package spoke:
//
//	c, err := tunnel.NewClient(tunnel.ClientConfig{Address: addr, Credentials: creds, Minter: m})
//	err = c.Run(ctx)
//
// The package knows nothing of consumers, Kubernetes clients or minting.
package tunnel
