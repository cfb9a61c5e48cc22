// Package fleet holds the names that the hub and the spokes of a fleet
// share: ClusterRef, the incarnation of a ClusterProfile that an agent
// serves; Cluster, what the exchange answers of one, as the ClusterProfile
// index finds it; the default SPIFFE IDs of an agent (AgentID) and of the broker
// (BrokerID); ErrNoAgent, for a cluster whose agent is not connected;
// MaxClockSkew, how far a spoke's clock may run ahead of the broker's; and
// the keys of the log lines that several packages write (LogErr, …).
//
// It imports nothing of credbroker, so that the tunnel, the exchange, the
// grant registry, the ClusterProfile index and the agent can all use it
// without importing each other:
//
//	id, err := fleet.AgentID(td, types.NamespacedName{Namespace: "fleet", Name: "prod-eu-1"})
//	// spiffe://<td>/clusterprofile/fleet/prod-eu-1
package fleet
