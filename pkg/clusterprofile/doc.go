// Package clusterprofile is the broker's view of the fleet: it maps the
// ClusterProfiles on the hub (sigs.k8s.io/cluster-inventory-api) to the
// SPIFFE IDs of the spoke agents allowed to serve them, and says how to reach
// each cluster's API server.
//
// # Agent identity
//
// An agent proves who it is with an X.509-SVID. AgentID gives the one SPIFFE
// ID that may serve a ClusterProfile:
//
//   - the value of the annotation credbroker.io/agent-spiffe-id when the
//     ClusterProfile has it; the value must be a SPIFFE ID with a path, in the
//     broker's trust domain, and not under the reserved path
//     /clusterprofile/ unless it is the profile's own default ID;
//   - otherwise spiffe://<trust domain>/clusterprofile/<namespace>/<name>.
//
// With the annotation set, the default ID no longer maps to that
// ClusterProfile. A ClusterProfile whose annotation is not a valid ID in the
// trust domain maps to no agent at all: the mapping fails closed.
//
// # Index
//
// Index answers, from an informer's cache, which ClusterProfile an agent
// serves (ForAgent), what a ClusterProfile looks like now (Get), and whether
// an agent can serve it (CheckAgent). A ClusterProfile that is being deleted
// counts as absent to Get. When several ClusterProfiles claim one agent ID,
// the one that claimed it first (earliest creationTimestamp, then lowest
// UID) holds it, even while it is being deleted: a newcomer can neither take
// an agent away from its cluster nor inherit it from a dying one.
//
//	factory := externalversions.NewSharedInformerFactory(client, 0)
//	idx, err := clusterprofile.New(clusterprofile.Config{
//		Informer:    factory.Apis().V1alpha1().ClusterProfiles().Informer(),
//		TrustDomain: td,
//		Log:         log,
//	})
//	// New must run before factory.Start.
//	idx.OnChange(func(key types.NamespacedName, uid types.UID) { /* re-check streams */ })
//	factory.Start(ctx.Done())
//	cache.WaitForCacheSync(ctx.Done(), idx.HasSynced)
//	cp, err := idx.ForAgent(svidID)
//	server, caData, ok := clusterprofile.Access(cp, "kubeconfig")
//
// Errors wrap the sentinels of package errdefs: ErrNotFound for a missing
// ClusterProfile; ErrPermissionDenied for an agent that maps to none, or
// whose holder is being deleted; ErrFailedPrecondition from CheckAgent for
// a ClusterProfile no agent can serve; ErrInvalidArgument for a bad
// annotation or Config; and ErrUnavailable before the informer's cache has
// synced.
package clusterprofile
