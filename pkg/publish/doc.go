// Package publish keeps the broker's access provider on ClusterProfiles.
//
// With --publish-access-provider, one broker replica (the holder of a
// coordination.k8s.io Lease) writes status.accessProviders[name=<provider>]
// (the server URL and CA that the connected agent advertised in its hello,
// and the exec extension client.authentication.k8s.io/exec naming the
// ClusterProfile, which credbroker-plugin reads) and the condition
// CredentialBrokerConnected into every ClusterProfile that has a connected
// agent. It writes with server-side apply on the status subresource under
// its own field manager: accessProviders and conditions are listType=map
// lists (keys name and type), so the entries of other managers are left
// alone. It writes only when the status differs from what it wants, turns
// the condition False only after a grace without agents, and paces its
// writes with a rate-limited work queue.
//
// No agent picks where consumers send tokens. A server is taken from the
// agents only when it is an https URL with a host and every live stream of
// the ClusterProfile (on this replica) that advertises a server advertises
// the same server and CA. Once an entry is in the status, whoever wrote it
// (the publisher, or an admin), it is pinned: the publisher keeps its
// server and CA whatever the agents advertise, and takes the agents' value
// again only after an admin removes the entry. A disagreement between
// agents, or with the pinned entry, and a non-https advertisement, are
// logged when they start or change, counted by Conflicts (the gauge
// credbroker_advertised_server_conflicts) and named in the condition.
package publish
