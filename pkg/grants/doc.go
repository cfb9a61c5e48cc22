// Package grants is the broker's view of the spoke tokens it handed out, and
// the way to revoke them.
//
// Every token an agent mints is bound to a grant: a Secret on the spoke,
// which the agent deletes to revoke the token (package spoke). The agents
// report their live grants in the hello of every stream and report each
// grant they create or delete afterwards, so every broker replica holds the
// whole fleet's live grants in memory, in a Registry, with no store of its
// own: a replica that restarts learns them again from the hellos.
//
// A Registry revokes through a Revoker, which the broker wires to the agent
// tunnel:
//
//	reg := grants.NewRegistry(grants.RegistryConfig{Revoker: tunnelServer})
//	revoked, pending := reg.Revoke(ctx, reg.Select(grants.Selector{Username: user}), "offboarded")
//
// A grant whose agent cannot be reached stays pending; the Registry sends
// its revoke again when the agent next reports it, in a hello or an update,
// or connects. With a PendingStore (RegistryConfig.Pending), the pending
// revokes are recorded in one ConfigMap of the hub before RevokeRecorded
// returns, and every replica watches it (Registry.Learn) and sends them
// too, so a revoke outlives the replica that took it; the replica that an
// agent confirms a revoke to drops its record.
// Until its token expires, a revoked credential id stays known as revoked,
// so the exchange's token cache never hands the token out again.
//
// A Service serves the Grants gRPC API over a Registry, beside TokenExchange
// on the broker's exchange port, and authenticates its callers as the
// exchange does. A caller may always list and revoke its own grants (same
// hub username and UID); other consumers' grants need hub RBAC on
// multicluster.x-k8s.io clusterprofiles/token of their ClusterProfile: list
// to see them, delete to revoke them. One SubjectAccessReview is made per
// ClusterProfile per call. List leaves out what the caller may not see;
// Revoke revokes nothing when any matching grant is not the caller's to
// revoke:
//
//	svc, err := grants.NewService(grants.ServiceConfig{
//		Authenticator: exchange, // *tokenexchange.Service
//		AccessReviews: hub.AuthorizationV1().SubjectAccessReviews(),
//		Grants:        reg,
//		Audit:         auditLog,
//	})
//	pb.RegisterGrantsServer(server, svc)
//
// Triggers revoke, through a Registry, the grants the hub no longer allows:
//   - hub RBAC no longer lets the consumer create clusterprofiles/token on
//     the grant's ClusterProfile: every change of a Role, RoleBinding,
//     ClusterRole or ClusterRoleBinding, debounced, leads to one
//     SubjectAccessReview per distinct consumer and ClusterProfile with live
//     grants, rate limited, the same review the exchange makes;
//   - the ClusterProfile is deleted, being deleted, or replaced by another
//     incarnation (ClusterProfileChanged, which the broker calls before it
//     closes the agent streams of that ClusterProfile);
//   - the consumer's hub ServiceAccount is deleted, or created again with
//     another UID (a metadata-only informer).
//
// A slow sweep checks every live grant in all three ways, for what no event
// told of. A review the hub fails revokes nothing; the next change or sweep
// asks again. The reviews are the same on every broker replica, so one
// replica runs the triggers, with Lead when it takes them over: that
// sweeps first, for what changed while no replica ran them.
package grants
