package spoke

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"golang.org/x/sync/errgroup"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/store"
)

// AllowEscalatingFlag is the agent's setting that allows escalating
// ServiceAccounts; refusals name it.
const AllowEscalatingFlag = "--allow-escalating-service-accounts"

// AllowAllInNamespace, as the name of an entry of Config.AllowEscalating,
// allows every ServiceAccount of the entry's namespace.
const AllowAllInNamespace = "*"

const (
	// DefaultEscalationTTL is the default Config.EscalationTTL.
	DefaultEscalationTTL = 10 * time.Second
	// escalationCacheSize bounds the ServiceAccounts whose answers are
	// kept.
	escalationCacheSize = 10000
	// reviewTimeout bounds one ServiceAccount's SubjectAccessReviews, which
	// run apart from the mint's context (they are shared by the mints that
	// wait for them).
	reviewTimeout = 10 * time.Second
)

// AccessReviewer asks the spoke API server what a subject may do, with a
// SubjectAccessReview. NewAccessReviewer adapts a clientset; tests use a
// fake.
type AccessReviewer interface {
	CreateSubjectAccessReview(ctx context.Context, review *authorizationv1.SubjectAccessReview) (*authorizationv1.SubjectAccessReview, error)
}

// NewAccessReviewer returns an AccessReviewer that calls
// AuthorizationV1().SubjectAccessReviews().Create on client. The client's
// identity needs create on subjectaccessreviews (authorization.k8s.io).
func NewAccessReviewer(client kubernetes.Interface) AccessReviewer {
	return clientAccessReviewer{client: client}
}

type clientAccessReviewer struct{ client kubernetes.Interface }

func (c clientAccessReviewer) CreateSubjectAccessReview(ctx context.Context, review *authorizationv1.SubjectAccessReview) (*authorizationv1.SubjectAccessReview, error) {
	return c.client.AuthorizationV1().SubjectAccessReviews().Create(ctx, review, metav1.CreateOptions{})
}

// escalation is one permission with which a token of a ServiceAccount can
// make itself a credential that no grant binds: a token of its own, or
// another identity's.
type escalation struct {
	// key names the escalation, for impliedBy.
	key string
	// impliedBy is the key of a broader escalation: a refusal names only
	// that one when the ServiceAccount has both.
	impliedBy string
	// attributes are the SubjectAccessReview's resource attributes for the
	// ServiceAccount namespace/name.
	attributes func(namespace, name string) authorizationv1.ResourceAttributes
	// describe says what the permission is, for a refusal.
	describe func(namespace, name string) string
}

// escalations are the permissions that the agent refuses a ServiceAccount,
// in the order a refusal names them. Each is asked of the API server as it
// would ask it of a request: create serviceaccounts/token for any name of
// the namespace, and for the ServiceAccount itself (a rule limited to its
// own name); impersonate serviceaccounts of the namespace (a review in the
// namespace also sees a ClusterRoleBinding's grant in every namespace) and
// impersonate users, which are cluster-wide. Impersonating groups, uids or
// extras is not asked: the API server refuses them unless a user or
// ServiceAccount is impersonated too, which these cover. Every review is a
// request to the spoke of the agent's own budget, so a new ServiceAccount
// costs four.
var escalations = []escalation{
	{
		key: "token",
		attributes: func(ns, _ string) authorizationv1.ResourceAttributes {
			return authorizationv1.ResourceAttributes{Namespace: ns, Verb: "create", Resource: "serviceaccounts", Subresource: "token"}
		},
		describe: func(ns, _ string) string { return "create serviceaccounts/token in namespace " + ns },
	},
	{
		key: "own-token", impliedBy: "token",
		attributes: func(ns, name string) authorizationv1.ResourceAttributes {
			return authorizationv1.ResourceAttributes{Namespace: ns, Verb: "create", Resource: "serviceaccounts", Subresource: "token", Name: name}
		},
		describe: func(ns, name string) string {
			return "create serviceaccounts/token for itself (" + ns + "/" + name + ")"
		},
	},
	{
		key: "impersonate-serviceaccounts",
		attributes: func(ns, _ string) authorizationv1.ResourceAttributes {
			return authorizationv1.ResourceAttributes{Namespace: ns, Verb: "impersonate", Resource: "serviceaccounts"}
		},
		describe: func(ns, _ string) string { return "impersonate serviceaccounts in namespace " + ns },
	},
	{
		key: "impersonate-users",
		attributes: func(string, string) authorizationv1.ResourceAttributes {
			return authorizationv1.ResourceAttributes{Verb: "impersonate", Resource: "users"}
		},
		describe: func(string, string) string { return "impersonate users" },
	},
}

// escalationChecker refuses ServiceAccounts that may escalate, unless the
// spoke admin allows them. Its answers are cached per ServiceAccount for a
// TTL, and concurrent mints for one ServiceAccount share one set of
// reviews.
type escalationChecker struct {
	access  AccessReviewer
	allowed []types.NamespacedName
	ttl     time.Duration
	clock   store.Clock
	// cache holds, per ServiceAccount, the descriptions of the escalating
	// permissions it has; empty for none.
	cache *store.Cache[string, []string]
}

func newEscalationChecker(access AccessReviewer, allowed []types.NamespacedName, ttl time.Duration, clk store.Clock) (*escalationChecker, error) {
	var errs []error
	for _, a := range allowed {
		if err := validateAllowEscalating(a); err != nil {
			errs = append(errs, err)
		}
	}
	if ttl < 0 {
		errs = append(errs, fmt.Errorf("EscalationTTL %s is negative", ttl))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("spoke config: %w", err)
	}
	if access == nil {
		// Nothing to ask, so nothing to cache.
		return &escalationChecker{allowed: allowed}, nil
	}
	if ttl == 0 {
		ttl = DefaultEscalationTTL
	}
	c, err := store.New[string, []string](store.Config{Size: escalationCacheSize, MaxTTL: ttl, Clock: clk})
	if err != nil {
		return nil, fmt.Errorf("spoke config: escalation cache: %w", err)
	}
	return &escalationChecker{access: access, allowed: allowed, ttl: ttl, clock: clk, cache: c}, nil
}

// ParseAllowEscalating parses one entry of the agent's
// AllowEscalatingFlag: namespace/name, or namespace/* for every
// ServiceAccount of the namespace.
func ParseAllowEscalating(s string) (types.NamespacedName, error) {
	ns, name, ok := strings.Cut(s, "/")
	if !ok {
		return types.NamespacedName{}, fmt.Errorf("%q: want namespace/name or namespace/*", s)
	}
	n := types.NamespacedName{Namespace: ns, Name: name}
	return n, validateAllowEscalating(n)
}

// validateAllowEscalating returns an error unless n is a namespace and a
// ServiceAccount name or AllowAllInNamespace.
func validateAllowEscalating(n types.NamespacedName) error {
	var problems []string
	if errs := validation.IsDNS1123Label(n.Namespace); len(errs) > 0 {
		problems = append(problems, fmt.Sprintf("namespace %q: %s", n.Namespace, strings.Join(errs, "; ")))
	}
	if n.Name != AllowAllInNamespace {
		if errs := validation.IsDNS1123Subdomain(n.Name); len(errs) > 0 {
			problems = append(problems, fmt.Sprintf("name %q is neither a ServiceAccount name nor %s: %s", n.Name, AllowAllInNamespace, strings.Join(errs, "; ")))
		}
	}
	if len(problems) > 0 {
		return fmt.Errorf("allowed escalating ServiceAccount %q: %s", n.Namespace+"/"+n.Name, strings.Join(problems, "; "))
	}
	return nil
}

// isAllowed reports whether the spoke admin allows sa to escalate.
func (c *escalationChecker) isAllowed(sa *corev1.ServiceAccount) bool {
	for _, a := range c.allowed {
		if a.Namespace == sa.Namespace && (a.Name == AllowAllInNamespace || a.Name == sa.Name) {
			return true
		}
	}
	return false
}

// check returns nil if sa may not escalate or the spoke admin allows it;
// an error wrapping ErrPermissionDenied that names its escalating
// permissions and how to allow them; or, when the spoke API server cannot
// say, an error wrapping ErrUnavailable (or the context's error): it fails
// closed.
func (c *escalationChecker) check(ctx context.Context, sa *corev1.ServiceAccount) error {
	if c.access == nil || c.isAllowed(sa) {
		return nil
	}
	ref := sa.Namespace + "/" + sa.Name
	key := "escalation:" + ref + "/" + string(sa.UID)
	found, _, err := c.cache.Do(ctx, key, func(ctx context.Context) ([]string, time.Time, error) {
		ctx, cancel := context.WithTimeout(ctx, reviewTimeout)
		defer cancel()
		found, err := c.review(ctx, sa)
		return found, c.clock.Now().Add(c.ttl), err
	})
	switch {
	case err != nil && ctx.Err() != nil:
		// Keep the context's error, so the caller sees Canceled or
		// DeadlineExceeded.
		return fmt.Errorf("ask the spoke API server whether ServiceAccount %s may escalate: %v: %w", ref, err, ctx.Err())
	case err != nil:
		return err
	case len(found) > 0:
		return fmt.Errorf("spoke ServiceAccount %s may %s, so a token for it could make itself a credential that no grant binds and no revoke ends; "+
			"remove that from its RBAC, or a spoke admin must allow it with the agent's %s=%s: %w",
			ref, strings.Join(found, " and "), AllowEscalatingFlag, ref, errdefs.ErrPermissionDenied)
	}
	return nil
}

// review asks the spoke API server every escalation for sa at once and
// returns the descriptions of those it allows, in escalations' order.
func (c *escalationChecker) review(ctx context.Context, sa *corev1.ServiceAccount) ([]string, error) {
	ref := sa.Namespace + "/" + sa.Name
	user := "system:serviceaccount:" + sa.Namespace + ":" + sa.Name
	groups := []string{"system:serviceaccounts", "system:serviceaccounts:" + sa.Namespace, "system:authenticated"}
	allowed := make([]bool, len(escalations))
	g, gctx := errgroup.WithContext(ctx)
	for i, e := range escalations {
		g.Go(func() error {
			attrs := e.attributes(sa.Namespace, sa.Name)
			out, err := c.access.CreateSubjectAccessReview(gctx, &authorizationv1.SubjectAccessReview{
				Spec: authorizationv1.SubjectAccessReviewSpec{User: user, UID: string(sa.UID), Groups: groups, ResourceAttributes: &attrs},
			})
			what := e.describe(sa.Namespace, sa.Name)
			switch {
			case err != nil:
				return reviewError(ref, what, err)
			case out == nil:
				return fmt.Errorf("ask the spoke API server whether ServiceAccount %s may %s: it returned no review: %w", ref, what, errdefs.ErrUnavailable)
			case !out.Status.Allowed && !out.Status.Denied && out.Status.EvaluationError != "":
				// An authorizer failed: "not allowed" is not known to be
				// true.
				return fmt.Errorf("ask the spoke API server whether ServiceAccount %s may %s: its authorizer failed (%s); "+
					"fix the spoke's RBAC or authorization webhook: %w", ref, what, out.Status.EvaluationError, errdefs.ErrUnavailable)
			}
			allowed[i] = out.Status.Allowed
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	has := map[string]bool{}
	for i, e := range escalations {
		has[e.key] = allowed[i]
	}
	found := []string{}
	for _, e := range escalations {
		if has[e.key] && !has[e.impliedBy] {
			found = append(found, e.describe(sa.Namespace, sa.Name))
		}
	}
	return found, nil
}

// reviewError maps an error of the SubjectAccessReview API to a sentinel.
func reviewError(ref, what string, err error) error {
	ask := fmt.Sprintf("ask the spoke API server whether ServiceAccount %s may %s", ref, what)
	// The reviews run under their own timeout, so a context error here is
	// the spoke API server's slowness: Unavailable, like any other failure.
	if apierrors.IsForbidden(err) {
		return fmt.Errorf("%s: the spoke API server forbids the agent to; grant the agent's ServiceAccount create on subjectaccessreviews (authorization.k8s.io): %v: %w",
			ask, err, errdefs.ErrUnavailable)
	}
	return fmt.Errorf("%s: %v: %w", ask, err, errdefs.ErrUnavailable)
}
