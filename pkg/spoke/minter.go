package spoke

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/protobuf/types/known/timestamppb"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"
	corev1listers "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/token"
	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

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

const (
	// DefaultMinExpiration is the default and the smallest MinExpiration: the
	// shortest lifetime the TokenRequest API accepts.
	DefaultMinExpiration = token.MinExpiration
	// DefaultMaxExpiration is the default MaxExpiration.
	DefaultMaxExpiration = time.Hour
	// maxTokenRequestExpiration is the longest lifetime the TokenRequest API
	// accepts.
	maxTokenRequestExpiration = (1 << 32) * time.Second
	// DefaultCollectInterval is the default CollectInterval.
	DefaultCollectInterval = time.Minute
	// cleanupTimeout bounds deleting a grant whose mint failed, which
	// outlives the mint's own context.
	cleanupTimeout = 10 * time.Second
)

// TokenCreator creates a token for a ServiceAccount with the TokenRequest
// API. NewTokenCreator adapts a clientset; tests use a fake.
type TokenCreator interface {
	CreateToken(ctx context.Context, namespace, name string, req *authenticationv1.TokenRequest) (*authenticationv1.TokenRequest, error)
}

// NewTokenCreator returns a TokenCreator that calls
// CoreV1().ServiceAccounts(namespace).CreateToken on client. The client's
// identity needs create on serviceaccounts/token.
func NewTokenCreator(client kubernetes.Interface) TokenCreator {
	return clientTokenCreator{client: client}
}

type clientTokenCreator struct{ client kubernetes.Interface }

func (c clientTokenCreator) CreateToken(ctx context.Context, namespace, name string, req *authenticationv1.TokenRequest) (*authenticationv1.TokenRequest, error) {
	return c.client.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, name, req, metav1.CreateOptions{})
}

// Config configures a Minter.
type Config struct {
	// Tokens mints tokens on the spoke; required.
	Tokens TokenCreator
	// ServiceAccounts reads the spoke's ServiceAccounts, and so their
	// AllowedSubjectsAnnotation, from an informer's cache, so a policy check
	// costs no API call; required. Wait for the informer to sync before the
	// first Mint: until then every ServiceAccount looks missing. Mint sees
	// only what the informer watches, so a namespace-scoped informer limits
	// the agent to that namespace.
	ServiceAccounts corev1listers.ServiceAccountLister
	// MinExpiration is the shortest lifetime of a minted token, in whole
	// seconds; shorter requests get it. Zero means DefaultMinExpiration,
	// which is also the smallest value allowed.
	MinExpiration time.Duration
	// MaxExpiration is the longest lifetime of a minted token, in whole
	// seconds; longer requests, and requests that name none, get it. Zero
	// means DefaultMaxExpiration. It must be at least MinExpiration.
	MaxExpiration time.Duration
	// Grants creates the grant Secret each token is bound to, and deletes
	// it when the token expires; required. Mint fails when it cannot create
	// one: there is no unbound token.
	Grants GrantStore
	// GrantCache is the agent's view of its grants: the indexer of the
	// informer NewGrantInformer returns (it needs GrantIndexers); required.
	// Run's sweep, Reconcile, Snapshot and Revoke read grants from it, so
	// that an agent costs the spoke API server a watch rather than a list
	// every CollectInterval. Register GrantEvents on that informer, and
	// wait for it to sync before Run and before the first Snapshot.
	GrantCache cache.Indexer
	// CollectInterval is how often Run lists grants to delete those whose
	// token has expired. Zero means DefaultCollectInterval.
	CollectInterval time.Duration
	// Access asks the spoke API server, with SubjectAccessReviews, whether
	// a ServiceAccount may create ServiceAccount tokens or impersonate:
	// Mint refuses such a ServiceAccount, whose token could make itself a
	// credential that no grant binds (escalation.go). The agent
	// passes NewAccessReviewer. Nil skips the check, for tests that fake
	// the spoke only.
	Access AccessReviewer
	// AllowEscalating are the ServiceAccounts that Mint serves even though
	// they may escalate: a Name of AllowAllInNamespace allows every one of
	// the Namespace. Only the spoke admin who runs the agent sets it, with
	// AllowEscalatingFlag; no annotation does.
	AllowEscalating []types.NamespacedName
	// EscalationTTL is how long Access's answers for a ServiceAccount are
	// kept: a change to its RBAC takes that long to be seen. Zero means
	// DefaultEscalationTTL.
	EscalationTTL time.Duration
	// Clock times grant expiry and the escalation answers; nil means the
	// real clock.
	Clock clock.WithTickerAndDelayedExecution
	// Log receives one line per mint and per refusal; the zero value
	// discards them. It never receives a token.
	Log logr.Logger
}

// Minter mints spoke ServiceAccount tokens for hub subjects under the
// spoke's own policy. It is safe for concurrent use.
type Minter struct {
	tokens     TokenCreator
	grants     GrantStore
	grantCache cache.Indexer
	sas        corev1listers.ServiceAccountLister
	minSeconds int64
	maxSeconds int64
	interval   time.Duration
	clock      clock.WithTickerAndDelayedExecution
	log        logr.Logger
	escalation *escalationChecker

	mu sync.Mutex
	// runCtx is Run's context while Run runs; nil otherwise. Grants minted
	// while Run does not run are left to its first sweep.
	runCtx context.Context
	// timers delete grants when their token expires, by grant UID.
	timers map[types.UID]clock.Timer
	// queue holds the ServiceAccounts whose policy changed, for Run to
	// revoke the grants it no longer allows; nil until Run starts it.
	queue workqueue.TypedRateLimitingInterface[types.NamespacedName]

	subMu sync.RWMutex
	// subscribers are called with every change to the grants (Subscribe).
	// Each is keyed by a pointer of its own, which Subscribe's unsubscribe
	// deletes.
	subscribers map[*func(*credbrokerv1alpha1.GrantUpdate)]struct{}

	// changes holds the grants someone other than the agent changed
	// (tamper.go).
	changes changeTracker
}

// New returns a Minter, or an error if cfg is incomplete or its expiration
// bounds are out of range.
func New(cfg Config) (*Minter, error) {
	if cfg.Tokens == nil {
		return nil, errors.New("spoke config: Tokens is required")
	}
	if cfg.ServiceAccounts == nil {
		return nil, errors.New("spoke config: ServiceAccounts is required")
	}
	if cfg.Grants == nil {
		return nil, errors.New("spoke config: Grants is required")
	}
	if cfg.GrantCache == nil {
		return nil, errors.New("spoke config: GrantCache is required")
	}
	for _, name := range slices.Sorted(maps.Keys(GrantIndexers())) {
		if _, ok := cfg.GrantCache.GetIndexers()[name]; !ok {
			return nil, fmt.Errorf("spoke config: GrantCache has no index %q; build it with GrantIndexers", name)
		}
	}
	if cfg.CollectInterval < 0 {
		return nil, fmt.Errorf("spoke config: CollectInterval %s is negative", cfg.CollectInterval)
	}
	interval := cfg.CollectInterval
	if interval == 0 {
		interval = DefaultCollectInterval
	}
	clk := cfg.Clock
	if clk == nil {
		clk = clock.RealClock{}
	}
	minExp, maxExp := cfg.MinExpiration, cfg.MaxExpiration
	if minExp == 0 {
		minExp = DefaultMinExpiration
	}
	if maxExp == 0 {
		maxExp = DefaultMaxExpiration
	}
	switch {
	case minExp%time.Second != 0 || maxExp%time.Second != 0:
		return nil, fmt.Errorf("spoke config: MinExpiration %s and MaxExpiration %s must be whole seconds", minExp, maxExp)
	case minExp < DefaultMinExpiration:
		return nil, fmt.Errorf("spoke config: MinExpiration %s is shorter than %s, the TokenRequest API's minimum", minExp, DefaultMinExpiration)
	case maxExp < minExp:
		return nil, fmt.Errorf("spoke config: MaxExpiration %s is shorter than MinExpiration %s", maxExp, minExp)
	case maxExp > maxTokenRequestExpiration:
		return nil, fmt.Errorf("spoke config: MaxExpiration %s is longer than %s, the TokenRequest API's maximum", maxExp, maxTokenRequestExpiration)
	}
	escalation, err := newEscalationChecker(cfg.Access, cfg.AllowEscalating, cfg.EscalationTTL, clk)
	if err != nil {
		return nil, err
	}
	return &Minter{
		escalation:  escalation,
		tokens:      cfg.Tokens,
		grants:      cfg.Grants,
		grantCache:  cfg.GrantCache,
		sas:         cfg.ServiceAccounts,
		minSeconds:  int64(minExp / time.Second),
		maxSeconds:  int64(maxExp / time.Second),
		interval:    interval,
		clock:       clk,
		log:         cfg.Log,
		timers:      map[types.UID]clock.Timer{},
		subscribers: map[*func(*credbrokerv1alpha1.GrantUpdate)]struct{}{},
	}, nil
}

// Mint mints a token for the ServiceAccount that req names, or, when it
// names none, for the single ServiceAccount that allows req's subject. The
// ServiceAccount must list the subject's username, or one of its groups
// after GroupSubjectPrefix, in its AllowedSubjectsAnnotation, and every audience req asks for in its
// AllowedAudiencesAnnotation. Errors wrap a sentinel from package errdefs:
// ErrInvalidArgument for a malformed request, ErrNotFound for a missing
// ServiceAccount, ErrPermissionDenied when no ServiceAccount allows the
// subject or the ServiceAccount does not allow an audience,
// ErrFailedPrecondition when several allow the subject and req names none, and
// ErrUnavailable when the spoke API server fails or refuses the agent.
// The grant records cluster, the hub ClusterProfile incarnation the
// request came through (the one the broker admitted the agent's stream
// for); a zero cluster records none.
// ErrPermissionDenied also refuses a ServiceAccount that may create
// ServiceAccount tokens or impersonate, unless Config.AllowEscalating
// allows it; when the spoke API server cannot say whether it may, Mint
// fails with ErrUnavailable. Each
// token is bound to a grant Secret created first (see the package doc); Mint
// fails rather than mint a token without one.
func (m *Minter) Mint(ctx context.Context, cluster fleet.ClusterRef, req *credbrokerv1alpha1.MintRequest) (*credbrokerv1alpha1.MintResponse, error) {
	if err := validate(req); err != nil {
		m.log.Info("refused mint request", "subject", req.GetSubject().GetUsername(), "error", err.Error())
		return nil, err
	}
	user := req.GetSubject().GetUsername()
	sa, err := m.pick(user, req.GetSubject().GetGroups(), req.GetServiceAccount())
	if err == nil {
		err = allowAudiences(sa, req.GetAudiences())
	}
	if err == nil {
		err = m.escalation.check(ctx, sa)
	}
	if err != nil {
		m.log.Info("refused mint request", "subject", user, "error", err.Error())
		return nil, err
	}
	ref := sa.Namespace + "/" + sa.Name
	seconds := m.expirationSeconds(req.GetExpirationSeconds())
	profile := profileName(cluster)
	grant, err := m.grants.Create(ctx, newGrant(grantInfo{
		serviceAccount: sa,
		hubUser:        user,
		hubUID:         req.GetSubject().GetUid(),
		hubGroups:      req.GetSubject().GetGroups(),
		clusterProfile: profile,
		clusterUID:     string(cluster.UID),
		audiences:      req.GetAudiences(),
		// The latest the token can expire; the patch below records when it
		// does.
		expiration: m.clock.Now().Add(time.Duration(seconds) * time.Second),
	}))
	if err == nil && (grant == nil || grant.Name == "" || grant.UID == "") {
		err = errors.New("the API server returned no name or UID")
	}
	if err != nil {
		err = createGrantError(ctx, sa.Namespace, err)
		m.log.Error(err, "failed to mint spoke token", "subject", user, "serviceAccount", ref)
		return nil, err
	}
	grantRef := sa.Namespace + "/" + grant.Name
	// Check the policy again now that the grant exists: a change the cache
	// took since pick shows here. A later one queues a Reconcile, and so
	// does this grant's arrival in the grant cache: whichever of the two
	// reaches the agent last, its Reconcile sees both and revokes it.
	if err := m.recheck(sa, grant); err != nil {
		m.deleteGrant(ctx, grant)
		m.log.Info("refused mint request", "subject", user, "error", err.Error())
		return nil, err
	}
	tr := &authenticationv1.TokenRequest{
		// The UID makes the API server refuse with a Conflict if the
		// ServiceAccount was replaced since the informer saw it, so a token is
		// never minted for an object whose annotation was not checked. Only
		// API servers of Kubernetes 1.34 and later enforce it; older ones
		// ignore it.
		ObjectMeta: metav1.ObjectMeta{UID: sa.UID},
		Spec: authenticationv1.TokenRequestSpec{
			Audiences:         slices.Clone(req.GetAudiences()),
			ExpirationSeconds: &seconds,
			// The token lives only as long as its grant.
			BoundObjectRef: &authenticationv1.BoundObjectReference{
				APIVersion: "v1", Kind: "Secret", Name: grant.Name, UID: grant.UID,
			},
		},
	}
	out, err := m.tokens.CreateToken(ctx, sa.Namespace, sa.Name, tr)
	if err == nil && (out == nil || out.Status.Token == "") {
		err = fmt.Errorf("spoke API server returned no token for ServiceAccount %s: %w", ref, errdefs.ErrUnavailable)
	} else if grantDeleted(err) {
		err = m.revokedDuringMint(sa, grant)
	} else if err != nil {
		err = createTokenError(ctx, ref, err)
	}
	if err != nil {
		m.deleteGrant(ctx, grant)
		m.log.Error(err, "failed to mint spoke token", "subject", user, "serviceAccount", ref, "grant", grantRef)
		return nil, err
	}
	exp := out.Status.ExpirationTimestamp.Time
	if exp.IsZero() {
		// An API server that leaves it out would have the grant collected,
		// and the token revoked, at once; the token lives no longer than
		// asked.
		exp = m.clock.Now().Add(time.Duration(seconds) * time.Second)
	}
	id := token.ID(out.Status.Token)
	patch, err := mintedPatch(id, sha256.Sum256([]byte(out.Status.Token)), exp)
	if err == nil {
		err = m.grants.Patch(ctx, sa.Namespace, grant.Name, patch)
	}
	if err != nil {
		// A grant without its credential id cannot be traced; revoke the
		// token by deleting it rather than hand it out.
		m.deleteGrant(ctx, grant)
		if grantDeleted(err) {
			err = m.revokedDuringMint(sa, grant)
		} else {
			err = fmt.Errorf("record credential id %s on grant %s: %v: %w", id, grantRef, err, errdefs.ErrUnavailable)
		}
		m.log.Error(err, "failed to mint spoke token", "subject", user, "serviceAccount", ref, "grant", grantRef)
		return nil, err
	}
	m.track(grant, exp)
	m.log.Info("minted spoke token",
		"subject", user,
		"serviceAccount", ref,
		"audiences", req.GetAudiences(),
		"expiration", exp.UTC().Format(time.RFC3339),
		"credentialID", id,
		"grant", grantRef,
		"clusterProfile", profile,
	)
	return &credbrokerv1alpha1.MintResponse{
		Token:          out.Status.Token,
		ExpirationTime: timestamppb.New(exp),
		ServiceAccount: &credbrokerv1alpha1.ObjectReference{Namespace: sa.Namespace, Name: sa.Name},
	}, nil
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

// grantDeleted reports whether err is the spoke API server saying that a
// grant Secret is not found: the TokenRequest's bound object, or the grant
// a patch names. A ServiceAccount that is not found is another answer.
func grantDeleted(err error) bool {
	var status apierrors.APIStatus
	if !apierrors.IsNotFound(err) || !errors.As(err, &status) {
		return false
	}
	d := status.Status().Details
	return d != nil && d.Group == "" && d.Kind == "secrets"
}

// revokedDuringMint returns the error of a mint whose grant was deleted,
// which revokes its token, before the token was handed out: Reconcile
// deleted it because the ServiceAccount changed its policy, which recheck
// then names, or someone revoked it. Either wraps ErrPermissionDenied,
// never ErrNotFound: the ServiceAccount exists.
func (m *Minter) revokedDuringMint(sa *corev1.ServiceAccount, grant *corev1.Secret) error {
	if err := m.recheck(sa, grant); err != nil {
		return err
	}
	return fmt.Errorf("the grant %s/%s of the token for spoke ServiceAccount %s/%s was deleted while the token was minted, which revokes the token; ask again: %w",
		grant.Namespace, grant.Name, sa.Namespace, sa.Name, errdefs.ErrPermissionDenied)
}

// deleteGrant deletes the grant of a mint that failed. It outlives ctx, as
// the mint may have failed because ctx ended; if it fails too, Run collects
// the grant once its expiration passes.
func (m *Minter) deleteGrant(ctx context.Context, grant *corev1.Secret) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	defer cancel()
	if err := m.grants.Delete(ctx, grant.Namespace, grant.Name, grant.UID); err != nil && !gone(err) {
		m.log.Error(err, "failed to delete the grant of a failed mint; it is collected when it expires",
			"grant", grant.Namespace+"/"+grant.Name)
	}
}

// AllowedSubjects returns the hub usernames that sa's
// AllowedSubjectsAnnotation lists, trimmed of spaces, without empty entries,
// in the annotation's order. It returns nil for a nil sa or one without the
// annotation.
func AllowedSubjects(sa *corev1.ServiceAccount) []string {
	return annotationList(sa, AllowedSubjectsAnnotation)
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

// validate returns an error wrapping ErrInvalidArgument that lists every
// problem with req.
func validate(req *credbrokerv1alpha1.MintRequest) error {
	if req == nil {
		return fmt.Errorf("mint request is missing: %w", errdefs.ErrInvalidArgument)
	}
	var problems []string
	if req.GetSubject().GetUsername() == "" {
		problems = append(problems, "subject.username is required")
	}
	if ref := req.GetServiceAccount(); ref != nil {
		if ref.GetNamespace() == "" {
			problems = append(problems, "service_account.namespace is required when service_account is set")
		} else if errs := validation.IsDNS1123Label(ref.GetNamespace()); len(errs) > 0 {
			problems = append(problems, fmt.Sprintf("service_account.namespace %q is not a valid namespace name: %s", ref.GetNamespace(), strings.Join(errs, "; ")))
		}
		if ref.GetName() == "" {
			problems = append(problems, "service_account.name is required when service_account is set")
		} else if errs := validation.IsDNS1123Subdomain(ref.GetName()); len(errs) > 0 {
			problems = append(problems, fmt.Sprintf("service_account.name %q is not a valid ServiceAccount name: %s", ref.GetName(), strings.Join(errs, "; ")))
		}
	}
	for i, a := range req.GetAudiences() {
		if a == "" {
			problems = append(problems, fmt.Sprintf("audiences[%d] is empty; omit audiences to get the spoke API server's default", i))
		}
	}
	if s := req.GetExpirationSeconds(); s < 0 {
		problems = append(problems, fmt.Sprintf("expiration_seconds %d is negative; use 0 for the maximum", s))
	}
	if len(problems) > 0 {
		return fmt.Errorf("mint request: %s: %w", strings.Join(problems, "; "), errdefs.ErrInvalidArgument)
	}
	return nil
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

// expirationSeconds applies the policy: 0 means the maximum, and other
// values are clamped to [min, max].
func (m *Minter) expirationSeconds(requested int64) int64 {
	if requested == 0 {
		return m.maxSeconds
	}
	return min(max(requested, m.minSeconds), m.maxSeconds)
}

// createTokenError maps an error of the TokenRequest API to a sentinel. The
// API server's message never contains a token.
func createTokenError(ctx context.Context, ref string, err error) error {
	switch {
	case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
		// Keep the context error, so the caller sees Canceled or
		// DeadlineExceeded rather than Unavailable.
		return fmt.Errorf("mint token for spoke ServiceAccount %s: %w", ref, err)
	case ctx.Err() != nil:
		return fmt.Errorf("mint token for spoke ServiceAccount %s: %v: %w", ref, err, ctx.Err())
	case apierrors.IsNotFound(err):
		return fmt.Errorf("spoke ServiceAccount %s: %w", ref, errdefs.ErrNotFound)
	case apierrors.IsForbidden(err):
		return fmt.Errorf("spoke API server forbids the agent to mint tokens for ServiceAccount %s; grant the agent's ServiceAccount create on serviceaccounts/token: %v: %w",
			ref, err, errdefs.ErrUnavailable)
	case apierrors.IsConflict(err):
		return fmt.Errorf("spoke ServiceAccount %s was replaced since the agent's cache saw it; retry once the cache catches up: %w", ref, errdefs.ErrUnavailable)
	}
	return fmt.Errorf("mint token for spoke ServiceAccount %s: %v: %w", ref, err, errdefs.ErrUnavailable)
}

// createGrantError maps an error creating a grant to a sentinel: the mint
// fails, as no token is minted without a grant.
func createGrantError(ctx context.Context, namespace string, err error) error {
	const what = "create the grant Secret the token would be bound to"
	switch {
	case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
		return fmt.Errorf("%s in namespace %s: %w", what, namespace, err)
	case ctx.Err() != nil:
		return fmt.Errorf("%s in namespace %s: %v: %w", what, namespace, err, ctx.Err())
	case apierrors.IsForbidden(err):
		return fmt.Errorf("spoke API server forbids the agent to %s in namespace %s, so no token is minted; "+
			"grant the agent's ServiceAccount create on secrets and check the credbroker-agent-grants admission policy: %v: %w",
			what, namespace, err, errdefs.ErrUnavailable)
	}
	return fmt.Errorf("%s in namespace %s, so no token is minted: %v: %w", what, namespace, err, errdefs.ErrUnavailable)
}
