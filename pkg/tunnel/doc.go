// Package tunnel carries mint and revoke requests from the broker to spoke
// agents over the AgentTunnel.Connect stream, which agents open outbound, and
// the agents' reports of the grants their tokens are bound to back.
//
// On the broker, a Server accepts streams, maps each agent's SPIFFE ID to one
// ClusterProfile through a Resolver, and keeps a registry of live sessions per
// cluster. Server.Mint sends a request down one live session of a cluster,
// the one that the namespace of its ServiceAccount (or its subject) picks by
// rendezvous hashing over the agent instances, and waits for the answer
// that carries the same correlation id, or for its deadline. A session
// takes requests only once its agent passed every check after its hello
// (its ClusterProfile still accepts it, its chain still verifies), and
// lives no longer than the SVID its agent presented: the Server verifies
// the chain again when a stream opens and on Reverify, and closes the
// stream at the chain's earliest NotAfter. An agent's refusal keeps its
// code only if it is one an agent may give, and its message reaches the
// consumer without control characters or links, clipped to 1 KiB; the
// agent logs the full text.
//
// The grants an agent reports in its hello, and its grant updates after it,
// go to ServerConfig.Grants (the broker's grant registry); a hello or update of more than MaxGrantsPerFrame grants closes the
// stream. Server.Revoke sends a RevokeRequest to every agent instance of
// the cluster, not to one stream as Mint does, in batches small enough for
// the answer, and counts an id gone only when every instance answered it
// gone, of the credential ids it asked about: a stream that holds a stolen
// SVID cannot answer a revoke for the honest agent.
//
//	srv, err := tunnel.NewServer(tunnel.ServerConfig{Resolver: r, Peer: identity.PeerSVID, Bundles: src, Grants: registry})
//	credbrokerv1alpha1.RegisterAgentTunnelServer(grpcServer, srv)
//	resp, err := srv.Mint(ctx, cluster, req)
//	gone, err := srv.Revoke(ctx, cluster, []string{"JTI=..."}, "reason")
//
// On the spoke, a Client holds one stream to one broker address, reconnects
// over a new connection with jittered exponential backoff, and hands every
// mint request to a Minter, which the agent wires to package spoke, with
// the ClusterProfile incarnation (fleet.ClusterRef) that the broker's
// admission headers named for the stream. With
// ClientConfig.Cluster set, it leaves a broker that admits it for another
// ClusterProfile. With ClientConfig.Grants set, every stream subscribes to
// the agent's grant updates, sends a snapshot in its hello (the grants that do
// not fit follow as updates), then forwards each update; a stream whose queue
// of updates overflows is closed, and the next hello carries a fresh
// snapshot. Revoke requests go to Grants.Revoke, under the same in-flight
// limit as mints:
//
//	c, err := tunnel.NewClient(tunnel.ClientConfig{Address: addr, Credentials: creds, Minter: m, Cluster: "fleet/east-1"})
//	err = c.Run(ctx)
//
// Draining: Server.Drain tells every stream, with a Drain frame, that the
// broker replica is shutting down, and refuses new streams (Unavailable);
// the streams still carry the requests of the exchanges in flight until
// Server.Close ends them. A Client whose Run context ends says goodbye (a
// Goodbye frame), answers its requests in flight within
// ClientConfig.DrainTimeout, and half-closes the stream; from the goodbye on,
// the Server sends nothing new down that stream and counts it no more
// (Connected), so mints go to the cluster's other streams, or, when there
// is none, wait up to ServerConfig.ReturnWait for the agent's next stream
// and are Unavailable after it. ClientConfig.Serving learns when a
// stream starts and stops serving, which the agent's readiness counts.
//
// When the agent's SVID rotates, it calls Client.Rotate: the Client opens a
// stream over a new connection (a handshake with the new SVID) and, once
// the broker admits it, the old one leaves the same way: goodbye, its
// requests in flight answered, half-close. Every stream of a Client names
// the Client in a request header; of the live streams of one agent SPIFFE
// ID and Client, the Server sends new requests down the newest only, from
// its admission on, before the old stream's goodbye arrives; and a request
// whose stream closes under it goes to another stream live then.
//
// The package knows nothing of consumers, Kubernetes clients or minting.
package tunnel
