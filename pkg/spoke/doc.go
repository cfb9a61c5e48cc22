// Package spoke is the minting half of the spoke agent: it turns a hub
// broker's MintRequest into a short-lived ServiceAccount token minted on the
// agent's own cluster with the TokenRequest API, under the spoke's own
// policy.
//
// # Policy
//
// The spoke decides, not the hub. A ServiceAccount opts in by listing hub
// subjects, comma-separated, in its AllowedSubjectsAnnotation: usernames,
// and hub groups as group:<name> (GroupSubjectPrefix):
//
//	metadata:
//	  annotations:
//	    credbroker.io/allowed-subjects: system:serviceaccount:argocd:argocd-application-controller,group:system:serviceaccounts:flux-system
//
// A plain entry matches the subject's username exactly, and never a group.
// A group:<name> entry matches a subject whose groups include <name>
// exactly, and never a username: a hub user named group:x is not allowed by
// the entry group:x unless it is in group x, so such a user cannot be
// listed by name. "group:" with an empty name matches nothing. There are no
// wildcards ("*" is an ordinary character), no prefixes and no case
// folding, the uid plays no part, and a group whose name holds a comma
// cannot be listed. The groups are those the hub's TokenReview reported
// for the consumer's own token, which the broker sends in the MintRequest;
// nothing in the consumer's request can add one. A group is wide:
// group:system:serviceaccounts:argocd allows every ServiceAccount of the
// hub namespace argocd, including ones created later, and
// group:system:authenticated every hub subject the hub's RBAC lets ask for
// this cluster. Everything else is denied:
//
//   - A request that names a ServiceAccount gets a token for it only if its
//     annotation lists the subject, by name or by one of its groups.
//   - A request that names none gets a token for the single ServiceAccount,
//     among all the informer sees, whose annotation lists the subject; it
//     is refused when there is none, and when there are several (say one
//     that lists it by name and one by group), so that the caller names
//     one.
//   - The lifetime is the request's, clamped to [MinExpiration,
//     MaxExpiration]; zero asks for MaxExpiration. The spoke API server may
//     shorten it further, and the response reports what it granted.
//   - Audiences: a request that names none gets the spoke API server's
//     default audiences. Any other audience must be listed, exactly, in the
//     ServiceAccount's AllowedAudiencesAnnotation (comma-separated), or the
//     request is refused; when the agent picks the ServiceAccount, it picks
//     as above and then checks the audiences. A token for an audience that
//     a cloud trusts for this ServiceAccount (sts.amazonaws.com for IRSA, a
//     workload identity pool, Vault's JWT auth) is a credential there.
//
// So a ServiceAccount whose IRSA role a consumer may assume also carries
//
//	credbroker.io/allowed-audiences: sts.amazonaws.com
//
// Policy is read from an informer's cache, so a check costs no API call and
// a change to an annotation takes effect once the informer sees it. The
// TokenRequest carries the cached ServiceAccount's UID, so a spoke API
// server of Kubernetes 1.34 or later refuses to mint for a ServiceAccount
// deleted and recreated since then; older API servers ignore the UID.
//
// # Grants
//
// Every token is bound to a grant: before each TokenRequest the Minter
// creates a Secret of type credbroker.io/grant (GrantType), named
// credbroker-grant-<random>, in the ServiceAccount's namespace. It holds no
// data. Its label credbroker.io/grant=true marks it for people (the agent
// knows a grant by its type, which cannot change), and its annotations
// name the hub user and UID, the hub ClusterProfile the broker admitted the
// agent for (the cluster Mint is given, with its UID), the
// ServiceAccount, the requested audiences and the expiry. The TokenRequest
// names the grant in spec.boundObjectRef, and once the token is minted the
// grant gets its credential id (credbroker.io/credential-id: JTI=<jti>, the
// value the spoke's audit log carries in
// authentication.kubernetes.io/credential-id and the broker's audit line in
// credentialID) and a label credbroker.io/jti=<jti>, so
//
//	kubectl get secrets -A -l credbroker.io/jti=<jti> -o yaml
//
// names the hub consumer of any request in the spoke's audit log.
//
// Deleting a grant revokes its token: the spoke API server refuses it once
// its token cache expires, about 10 s later. There is no unbound token: when
// the grant cannot be created, Mint fails with ErrUnavailable and asks for
// no token; when the TokenRequest fails, or the credential id cannot be
// recorded, Mint deletes the grant and fails.
//
// With Config.PoolSize above zero, the grant can exist before the request:
// Run keeps up to PoolSize pooled grants per ServiceAccount Mint has minted
// for, which name only the ServiceAccount and an expiry ten minutes out.
// Mint binds its token to one, answers, and then claims the grant with one
// patch that writes everything above at once; a claim that fails deletes
// the grant, which revokes the token. A pooled grant no token is bound to
// yet is an empty Secret; the agent uses only those it created itself and
// its informer shows unchanged (pool.go, claim.go).
//
// The agent reads its grants from an informer (NewGrantInformer: one watch
// on Secrets selected by type, indexed by ServiceAccount and by credential
// id), never by listing them every interval. Only the agent writes a grant
// (deploy/spoke/admission.yaml); a grant that differs from what the agent
// wrote (one of its credbroker.io/ labels or annotations, a finalizer,
// data; other labels and annotations are ignored), even one being deleted,
// was changed by someone else, and the agent deletes it, which revokes its token, and reports its
// removal only once it is gone. Run collects
// grants: it deletes each one when its token expires (a timer on
// Config.Clock), and every CollectInterval, starting at once, it looks
// through the cache and deletes those whose expiry has passed. The sweep is
// what collects the grants of an agent that crashed or restarted, whose
// timers died with it; so no grant outlives its token by more than one
// CollectInterval while an agent runs.
//
// Withdrawing an opt-in revokes: when a ServiceAccount's
// AllowedSubjectsAnnotation stops listing a hub user, or a group entry that
// allowed it (each grant is judged by the hub groups it recorded, as Mint
// judged the request), or its
// AllowedAudiencesAnnotation stops listing an audience, the Minter deletes
// the grants of that ServiceAccount that its policy, checked as Mint checks
// it, no longer allows, and the spoke refuses their tokens about 10 s
// later. Grants it still allows, and other ServiceAccounts', stay. The
// agent's informer calls PolicyChanged on every update; a change to either
// annotation queues the ServiceAccount (a workqueue: bursts coalesce,
// failures retry with backoff), and Run's worker calls Reconcile, which
// reads only that ServiceAccount's grants from the cache's index. A grant
// that reaches the cache queues its ServiceAccount too, so a policy change
// seen before the grant still revokes it. Each sweep also
// checks every live grant against its ServiceAccount in the cache, so an
// agent that was down when the annotation changed revokes at start-up, at
// the cost of no extra API call. A deleted ServiceAccount needs nothing:
// its tokens die with it, and its grants are collected when they expire.
// Mint checks the policy again once its grant exists, so a change that
// lands while a token is being minted either refuses the mint or finds the
// grant to revoke.
//
// The Minter is also the agent's side of revocation by the broker (the
// tunnel package's Grants): Snapshot reports every grant with a credential
// id for the hello of each broker stream, Subscribe reports grants as the
// informer sees them recorded and deleted, and Revoke deletes the grants of
// the credential ids a broker names, but only those recorded for the
// ClusterProfile that broker admitted the agent for. Grants record the hub
// subject's groups and the ClusterProfile's UID, so that a restarted broker
// can check them again.
//
// # Use
//
// Build a Minter from a clientset, a synced ServiceAccount informer and a
// synced grant informer, then call Mint for each MintRequest:
//
//	factory := informers.NewSharedInformerFactory(client, 0)
//	sas := factory.Core().V1().ServiceAccounts()
//	lister := sas.Lister() // register the informer before Start
//	grants := spoke.NewGrantInformer(client, "")
//	factory.Start(ctx.Done())
//	go grants.RunWithContext(ctx)
//	factory.WaitForCacheSync(ctx.Done())
//	cache.WaitForCacheSync(ctx.Done(), grants.HasSynced)
//	m, err := spoke.New(spoke.Config{
//		Tokens:          spoke.NewTokenCreator(client),
//		Grants:          spoke.NewGrantStore(client, ""),
//		GrantCache:      grants.GetIndexer(),
//		ServiceAccounts: lister,
//		Log:             log,
//	})
//	...
//	grants.AddEventHandler(m.GrantEvents())
//	sas.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
//		UpdateFunc: func(old, now any) {
//			m.PolicyChanged(old.(*corev1.ServiceAccount), now.(*corev1.ServiceAccount))
//		},
//	})
//	go m.Run(ctx) // collects expired grants, revokes withdrawn ones
//	resp, err := m.Mint(ctx, cluster, req) // cluster: the ClusterProfile the broker admitted the stream for
//
// The agent's own identity needs list and watch on serviceaccounts, create
// on serviceaccounts/token, and create, patch, delete, list and watch on
// secrets.
// RBAC cannot narrow the secrets verbs to grants; deploy/spoke/admission.yaml
// refuses the agent any write to a Secret that is not a grant, and any
// TokenRequest not bound to a Secret named credbroker-grant-…. Mint's errors wrap the sentinels of
// package errdefs, and their messages say what to change; none contains a
// token, and neither does the log, which names a token by its credential
// ID (token.ID).
package spoke
