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
package publish
