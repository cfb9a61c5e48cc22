package spoke

import (
	"context"
	"fmt"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/credbroker/credbroker/pkg/errdefs"
	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// The spoke's policy: which hub subjects may get a token for which
// ServiceAccount, for which audiences and how long (see the package doc).
// Mint applies it before it creates a grant, and once more after; Reconcile
// applies it to the live grants when a ServiceAccount changes. The refusal
// of ServiceAccounts that may escalate is in escalation.go.

// AllowedSubjectsAnnotation, on a spoke ServiceAccount, lists the hub
// subjects that may get tokens for it, separated by commas: usernames, such
// as "system:serviceaccount:argocd:argocd-application-controller", and
// groups, as GroupSubjectPrefix and the group's name, such as
// "group:system:serviceaccounts:argocd". A ServiceAccount without it allows
// nobody.
const AllowedSubjectsAnnotation = "credbroker.io/allowed-subjects"

// GroupSubjectPrefix marks an entry of AllowedSubjectsAnnotation that names
// a hub group rather than a username: "group:<name>" allows every hub
// subject whose groups, as the hub's TokenReview reports them, include
// <name> exactly. "group:" with an empty name allows nobody.
const GroupSubjectPrefix = "group:"

// AllowedAudiencesAnnotation, on a spoke ServiceAccount, lists the token
// audiences a hub subject may ask for, separated by commas, such as
// "sts.amazonaws.com" or "https://vault.example". A ServiceAccount without
// it allows only the spoke API server's default audiences, that is a
// request that names none: a token for an audience that a cloud or Vault
// trusts for this ServiceAccount is a credential there.
const AllowedAudiencesAnnotation = "credbroker.io/allowed-audiences"

// authorize returns the ServiceAccount to mint req's token for: the one req
// names, or else the single one that allows req's subject. It must allow
// the subject and every audience req asks for, and may not escalate unless
// Config.AllowEscalating allows it. The returned object belongs to the
// informer's cache and must not be modified.
func (m *Minter) authorize(ctx context.Context, req *credbrokerv1alpha1.MintRequest) (*corev1.ServiceAccount, error) {
	sa, err := m.pick(req.GetSubject().GetUsername(), req.GetSubject().GetGroups(), req.GetServiceAccount())
	if err != nil {
		return nil, err
	}
	if err := allowAudiences(sa, req.GetAudiences()); err != nil {
		return nil, err
	}
	if err := m.escalation.check(ctx, sa); err != nil {
		return nil, err
	}
	return sa, nil
}

// pick returns the ServiceAccount to mint for, applying the policy. The
// returned object belongs to the informer's cache and must not be modified.
func (m *Minter) pick(user string, groups []string, ref *credbrokerv1alpha1.ObjectReference) (*corev1.ServiceAccount, error) {
	if ref != nil {
		name := ref.GetNamespace() + "/" + ref.GetName()
		sa, err := m.sas.ServiceAccounts(ref.GetNamespace()).Get(ref.GetName())
		switch {
		case apierrors.IsNotFound(err):
			return nil, fmt.Errorf("spoke ServiceAccount %s: %w", name, errdefs.ErrNotFound)
		case err != nil:
			return nil, fmt.Errorf("read spoke ServiceAccount %s from the agent's cache: %v: %w", name, err, errdefs.ErrUnavailable)
		case !allows(sa, user, groups):
			return nil, fmt.Errorf("spoke ServiceAccount %s does not allow hub user %s; a spoke admin must add %s to its %s annotation: %w",
				name, user, user, AllowedSubjectsAnnotation, errdefs.ErrPermissionDenied)
		}
		return sa, nil
	}
	all, err := m.sas.List(labels.Everything())
	if err != nil {
		return nil, fmt.Errorf("list spoke ServiceAccounts from the agent's cache: %v: %w", err, errdefs.ErrUnavailable)
	}
	var matches []*corev1.ServiceAccount
	for _, sa := range all {
		if allows(sa, user, groups) {
			matches = append(matches, sa)
		}
	}
	switch len(matches) {
	case 0:
		return nil, fmt.Errorf("no spoke ServiceAccount allows hub user %s; a spoke admin must annotate one with %s: %w",
			user, AllowedSubjectsAnnotation, errdefs.ErrPermissionDenied)
	case 1:
		return matches[0], nil
	}
	names := make([]string, len(matches))
	for i, sa := range matches {
		names[i] = sa.Namespace + "/" + sa.Name
	}
	slices.Sort(names)
	return nil, fmt.Errorf("several spoke ServiceAccounts allow hub user %s (%s); name one in the request: %w",
		user, strings.Join(names, ", "), errdefs.ErrFailedPrecondition)
}

// allows reports whether sa's AllowedSubjectsAnnotation lists the hub
// subject with username user and groups: an entry equal to user, or
// GroupSubjectPrefix followed by one of groups. Matches are exact: an entry
// that starts with GroupSubjectPrefix never matches a username, a plain
// entry never matches a group, and no character is a wildcard.
func allows(sa *corev1.ServiceAccount, user string, groups []string) bool {
	for _, e := range AllowedSubjects(sa) {
		if group, ok := strings.CutPrefix(e, GroupSubjectPrefix); ok {
			if group != "" && slices.Contains(groups, group) {
				return true
			}
			continue
		}
		if e == user {
			return true
		}
	}
	return false
}

// AllowedSubjects returns the hub usernames that sa's
// AllowedSubjectsAnnotation lists, trimmed of spaces, without empty entries,
// in the annotation's order. It returns nil for a nil sa or one without the
// annotation.
func AllowedSubjects(sa *corev1.ServiceAccount) []string {
	return annotationList(sa, AllowedSubjectsAnnotation)
}

// AllowedAudiences returns the audiences that sa's
// AllowedAudiencesAnnotation lists, trimmed of spaces, without empty
// entries, in the annotation's order. It returns nil for a nil sa or one
// without the annotation.
func AllowedAudiences(sa *corev1.ServiceAccount) []string {
	return annotationList(sa, AllowedAudiencesAnnotation)
}

// annotationList returns the comma-separated entries of sa's annotation key,
// trimmed of spaces, without empty entries, in the annotation's order; nil
// for a nil sa or one without the annotation.
func annotationList(sa *corev1.ServiceAccount, key string) []string {
	if sa == nil {
		return nil
	}
	var entries []string
	for e := range strings.SplitSeq(sa.Annotations[key], ",") {
		if e = strings.TrimSpace(e); e != "" {
			entries = append(entries, e)
		}
	}
	return entries
}

// allowAudiences returns an error wrapping ErrPermissionDenied unless sa's
// AllowedAudiencesAnnotation lists every one of audiences. No audiences,
// the spoke API server's default, is always allowed.
func allowAudiences(sa *corev1.ServiceAccount, audiences []string) error {
	if len(audiences) == 0 {
		return nil
	}
	allowed := AllowedAudiences(sa)
	for _, a := range audiences {
		if !slices.Contains(allowed, a) {
			return fmt.Errorf("spoke ServiceAccount %s/%s does not allow audience %q; a spoke admin must add it to its %s annotation: %w",
				sa.Namespace, sa.Name, a, AllowedAudiencesAnnotation, errdefs.ErrPermissionDenied)
		}
	}
	return nil
}

// expirationSeconds applies the policy: 0 means the maximum, and other
// values are clamped to [min, max].
func (m *Minter) expirationSeconds(requested int64) int64 {
	if requested == 0 {
		return m.maxSeconds
	}
	return min(max(requested, m.minSeconds), m.maxSeconds)
}

// recheck returns an error wrapping ErrPermissionDenied unless the cached
// sa still allows grant, or ErrNotFound if sa is gone from the cache.
func (m *Minter) recheck(sa *corev1.ServiceAccount, grant *corev1.Secret) error {
	ref := sa.Namespace + "/" + sa.Name
	now, err := m.sas.ServiceAccounts(sa.Namespace).Get(sa.Name)
	switch {
	case apierrors.IsNotFound(err):
		return fmt.Errorf("spoke ServiceAccount %s was deleted while the token was minted: %w", ref, errdefs.ErrNotFound)
	case err != nil:
		return fmt.Errorf("read spoke ServiceAccount %s from the agent's cache: %v: %w", ref, err, errdefs.ErrUnavailable)
	}
	if why := disallowed(now, grant); why != "" {
		return fmt.Errorf("spoke ServiceAccount %s changed its policy while the token was minted: %s: %w", ref, why, errdefs.ErrPermissionDenied)
	}
	return nil
}

// disallowed returns why sa's policy no longer allows grant's token, or ""
// when it does.
func disallowed(sa *corev1.ServiceAccount, grant *corev1.Secret) string {
	// The groups are those the hub's TokenReview reported when the token was
	// minted, as the grant recorded them: a grant allowed only by a group
	// entry is revoked once that entry goes.
	if !allows(sa, grant.Annotations[GrantHubUserAnnotation], splitGroups(grant.Annotations[GrantHubGroupsAnnotation])) {
		return "the ServiceAccount no longer allows the hub user"
	}
	if allowAudiences(sa, grantAudiences(grant)) != nil {
		return "the ServiceAccount no longer allows an audience of the token"
	}
	return ""
}
