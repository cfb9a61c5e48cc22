// Package hubauth holds what the broker's consumer-facing services share
// about a caller's hub identity: the User a TokenReview returned, and the
// SubjectAccessReview that asks the hub whether that user may act on a
// ClusterProfile's token subresource.
//
// The exchange asks for VerbCreate; the Grants service for VerbList and
// VerbDelete:
//
//	review := hubauth.AccessReview(user, hubauth.VerbDelete, types.NamespacedName{Namespace: "fleet", Name: "prod-eu-1"})
//	answer, err := client.Create(ctx, review, metav1.CreateOptions{})
//	ok := err == nil && hubauth.Allowed(answer)
//
// It imports neither gRPC nor the other broker packages, so that
// pkg/tokenexchange and pkg/grants can both use it.
package hubauth
