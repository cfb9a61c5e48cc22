// Package tokenexchange is the consumer-facing TokenExchange service of the
// broker.
//
// Exchange runs five steps, each of which can end the call with the gRPC code
// from package errdefs:
//
//  1. authenticate the caller's bearer token with a hub TokenReview for the
//     broker's audience (cached by an HMAC of the token, never past the
//     token's own expiry). A token not in the cache must first pass the
//     Verifier (its signature against the hub issuer's keys, its expiry
//     and audience; forged tokens cost no hub call), then a limit on the
//     reviews that its peer address triggers, then the broker-wide one;
//  2. authorize it with a hub SubjectAccessReview for create on
//     multicluster.x-k8s.io clusterprofiles/token, for the named
//     ClusterProfile (allowed and denied decisions cached separately);
//  3. look up the ClusterProfile, which must name the spoke's server (the
//     consumer's plugin hands the token to no other);
//  4. reuse a minted token for the same cluster incarnation, consumer, spoke
//     ServiceAccount and audiences while at least half its lifetime remains,
//     with one mint for concurrent misses, unless the Grants registry
//     reports it revoked: then it is dropped and a new one minted;
//  5. mint through the agent tunnel, check the agent's answer, and record
//     the new token's grant in the Grants registry, so that this replica
//     can revoke it at once.
//
// The agent may be compromised, so its answer is checked before it is cached,
// audited or returned: the token's claims, read without verifying the spoke's
// signature, must name the ServiceAccount the answer names (and the requested
// one, if any) in sub, carry the requested audiences (or, when none were
// requested, some), expire after now and no later than MaxExpiration plus
// fleet.MaxClockSkew from now, and agree with the answer's expiration_time. An
// answer that fails is Unavailable for the consumer and an error in the log
// that names the cluster and the check.
//
// Each consumer has a rate limit (Config.RateLimit, RateBurst) on what costs
// the hub and the spokes: its TokenReviews and SubjectAccessReviews not
// served from the decision caches, and its mints. Answers from the caches
// do not count, so a controller that starts with a thousand clusters and
// asks for each token many times is not refused. A mint or access review
// over the limit is refused before it is sent; a TokenReview, which alone
// says who the consumer is, counts once done. A refusal is
// ResourceExhausted, with the wait in its message and in the "retry-after"
// trailer (errdefs.RetryAfterKey), whole seconds from the limiter's
// reservation; it spends none of the budget. So are the refusals of the
// review limits per peer address, per hub namespace and broker-wide.
//
// A consumer that keeps calling has its TokenReview and its allowed
// SubjectAccessReviews refreshed in the background in the last quarter of
// their life (store.Config.RefreshWithin): its calls are served from the
// caches and never wait on the hub nor meet a review limit. A refresh is
// not charged to the peer address's limit, and waits for the others until
// the decision it refreshes ends.
//
// Every call writes one audit line. Tokens never reach a log, an error or a
// metric; the audit line names the minted token by its credential id, and
// records its checked claims, not what the agent said beside it. With
// Config.AuditLog, the service encodes the line itself as one JSON line,
// without logr or reflection, scanning every string a caller, the hub or
// an agent chose for tokens while it appends it (token.AppendRedacted);
// without, the line's key/values go to Config.Audit.
//
//	svc, err := tokenexchange.New(tokenexchange.Config{
//		TokenReviews: hub.AuthenticationV1().TokenReviews(),
//		AccessReviews: hub.AuthorizationV1().SubjectAccessReviews(),
//		Verifier: hubKeys, // a *hubkeys.Keys
//		Clusters: clusters, Minter: tunnelServer,
//	})
//	credbrokerv1alpha1.RegisterTokenExchangeServer(grpcServer, svc)
package tokenexchange
