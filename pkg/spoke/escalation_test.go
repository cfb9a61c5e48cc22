package spoke

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	authorizationv1 "k8s.io/api/authorization/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// The SubjectAccessReviews' resource attributes for apps/deployer, by what
// they ask.
var (
	tokenAny = authorizationv1.ResourceAttributes{Namespace: "apps", Verb: "create", Resource: "serviceaccounts", Subresource: "token"}
	tokenOwn = authorizationv1.ResourceAttributes{Namespace: "apps", Verb: "create", Resource: "serviceaccounts", Subresource: "token", Name: "deployer"}
	impNS    = authorizationv1.ResourceAttributes{Namespace: "apps", Verb: "impersonate", Resource: "serviceaccounts"}
	impUsers = authorizationv1.ResourceAttributes{Verb: "impersonate", Resource: "users"}
	impGroup = authorizationv1.ResourceAttributes{Verb: "impersonate", Resource: "groups"}
	impUIDs  = authorizationv1.ResourceAttributes{Verb: "impersonate", Group: "authentication.k8s.io", Resource: "uids"}
)

// fakeAccess is an AccessReviewer that records its reviews and answers
// from allow: allowed for the attributes it holds, denied for others. err
// fails every review; status, when set, is every review's answer.
type fakeAccess struct {
	mu     sync.Mutex
	allow  map[authorizationv1.ResourceAttributes]bool
	err    error
	status *authorizationv1.SubjectAccessReviewStatus
	nilOut bool
	// gate, when set, holds every review until it is closed.
	gate    chan struct{}
	reviews []authorizationv1.SubjectAccessReviewSpec
}

func allowing(attrs ...authorizationv1.ResourceAttributes) *fakeAccess {
	f := &fakeAccess{allow: map[authorizationv1.ResourceAttributes]bool{}}
	for _, a := range attrs {
		f.allow[a] = true
	}
	return f
}

func (f *fakeAccess) CreateSubjectAccessReview(ctx context.Context, review *authorizationv1.SubjectAccessReview) (*authorizationv1.SubjectAccessReview, error) {
	f.mu.Lock()
	f.reviews = append(f.reviews, *review.Spec.DeepCopy())
	gate := f.gate
	f.mu.Unlock()
	if gate != nil {
		select {
		case <-gate:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case f.err != nil:
		return nil, f.err
	case f.nilOut:
		return nil, nil
	}
	out := review.DeepCopy()
	if f.status != nil {
		out.Status = *f.status
		return out, nil
	}
	out.Status.Allowed = f.allow[*review.Spec.ResourceAttributes]
	return out, nil
}

func (f *fakeAccess) set(attrs ...authorizationv1.ResourceAttributes) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.allow = map[authorizationv1.ResourceAttributes]bool{}
	for _, a := range attrs {
		f.allow[a] = true
	}
}

func (f *fakeAccess) Reviews() []authorizationv1.SubjectAccessReviewSpec {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]authorizationv1.SubjectAccessReviewSpec(nil), f.reviews...)
}

func escalationMinter(t *testing.T, tokens TokenCreator, access AccessReviewer, allowed []types.NamespacedName, clk *testingclock.FakeClock) (*Minter, *fakeGrants) {
	t.Helper()
	grants := newFakeGrants()
	cfg := withGrants(Config{Tokens: tokens, ServiceAccounts: lister(t, serviceAccount("apps", "deployer", argocd)),
		Access: access, AllowEscalating: allowed}, grants)
	if clk != nil {
		cfg.Clock = clk
	}
	m, err := New(cfg)
	require.NoError(t, err)
	return m, grants
}

// all and unchecked are wantReviews of TestMintRefusesEscalatingServiceAccount.
const (
	all       = -1
	unchecked = -2
)

const refusalTail = ", so a token for it could make itself a credential that no grant binds and no revoke ends; " +
	"remove that from its RBAC, or a spoke admin must allow it with the agent's --allow-escalating-service-accounts=apps/deployer: permission denied"

// A ServiceAccount that may create ServiceAccount tokens or impersonate is
// refused with PermissionDenied that names what it may do and how to allow
// it, before any grant or token exists; the spoke admin's setting, and only
// it, allows one; a spoke API server that cannot say fails closed.
func TestMintRefusesEscalatingServiceAccount(t *testing.T) {
	forbidden := apierrors.NewForbidden(schema.GroupResource{Group: "authorization.k8s.io", Resource: "subjectaccessreviews"}, "",
		errors.New(`User "system:serviceaccount:credbroker:agent" cannot create resource "subjectaccessreviews"`))
	tests := []struct {
		name     string
		access   *fakeAccess
		allowed  []types.NamespacedName
		wantErr  string
		sentinel error
		// wantReviews is the number of reviews asked: all, none (0), or
		// unchecked.
		wantReviews int
	}{
		{name: "narrow", access: allowing(), wantReviews: all},
		{name: "create tokens in its namespace", access: allowing(tokenAny, tokenOwn),
			wantErr: "spoke ServiceAccount apps/deployer may create serviceaccounts/token in namespace apps" + refusalTail, sentinel: errdefs.ErrPermissionDenied, wantReviews: all},
		{name: "create its own token only", access: allowing(tokenOwn),
			wantErr: "spoke ServiceAccount apps/deployer may create serviceaccounts/token for itself (apps/deployer)" + refusalTail, sentinel: errdefs.ErrPermissionDenied, wantReviews: all},
		{name: "impersonate ServiceAccounts of its namespace", access: allowing(impNS),
			wantErr: "spoke ServiceAccount apps/deployer may impersonate serviceaccounts in namespace apps" + refusalTail, sentinel: errdefs.ErrPermissionDenied, wantReviews: all},
		{name: "impersonate users", access: allowing(impUsers),
			wantErr: "spoke ServiceAccount apps/deployer may impersonate users" + refusalTail, sentinel: errdefs.ErrPermissionDenied, wantReviews: all},
		// Groups and uids cannot be impersonated without a user, which the
		// reviews above cover; they are not asked.
		{name: "impersonate groups and uids only", access: allowing(impGroup, impUIDs), wantReviews: all},
		{name: "the built-in edit role", access: allowing(tokenAny, tokenOwn, impNS),
			wantErr:  "spoke ServiceAccount apps/deployer may create serviceaccounts/token in namespace apps and impersonate serviceaccounts in namespace apps" + refusalTail,
			sentinel: errdefs.ErrPermissionDenied, wantReviews: all},
		{name: "allowed by name", access: allowing(tokenAny, impNS), allowed: []types.NamespacedName{{Namespace: "apps", Name: "deployer"}}},
		{name: "allowed with its namespace", access: allowing(tokenAny, impNS), allowed: []types.NamespacedName{{Namespace: "apps", Name: "*"}}},
		{name: "another ServiceAccount allowed", access: allowing(tokenAny), allowed: []types.NamespacedName{{Namespace: "apps", Name: "builder"}, {Namespace: "other", Name: "*"}},
			wantErr: "spoke ServiceAccount apps/deployer may create serviceaccounts/token in namespace apps" + refusalTail, sentinel: errdefs.ErrPermissionDenied, wantReviews: all},
		{name: "the spoke API server fails", access: &fakeAccess{err: apierrors.NewInternalError(errors.New("etcd is down"))},
			wantErr:  "ask the spoke API server whether ServiceAccount apps/deployer may ",
			sentinel: errdefs.ErrUnavailable, wantReviews: unchecked},
		{name: "the agent may not review", access: &fakeAccess{err: forbidden},
			wantErr:  "the spoke API server forbids the agent to; grant the agent's ServiceAccount create on subjectaccessreviews (authorization.k8s.io)",
			sentinel: errdefs.ErrUnavailable, wantReviews: unchecked},
		{name: "no review returned", access: &fakeAccess{nilOut: true},
			wantErr: "it returned no review: unavailable", sentinel: errdefs.ErrUnavailable, wantReviews: unchecked},
		{name: "an authorizer fails without deciding", access: &fakeAccess{status: &authorizationv1.SubjectAccessReviewStatus{EvaluationError: "webhook timed out"}},
			wantErr: "its authorizer failed (webhook timed out); fix the spoke's RBAC or authorization webhook: unavailable", sentinel: errdefs.ErrUnavailable,
			wantReviews: unchecked},
		{name: "an authorizer fails but another denies", access: &fakeAccess{status: &authorizationv1.SubjectAccessReviewStatus{Denied: true, EvaluationError: "webhook timed out"}},
			wantReviews: all},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tokens := &fakeTokens{}
			m, grants := escalationMinter(t, tokens, tt.access, tt.allowed, nil)
			resp, err := m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref("apps", "deployer")})
			switch tt.wantReviews {
			case all:
				assert.Len(t, tt.access.Reviews(), len(escalations))
			case unchecked:
				// A failure ends the other reviews early.
				assert.NotEmpty(t, tt.access.Reviews())
			default:
				assert.Len(t, tt.access.Reviews(), tt.wantReviews)
			}
			if tt.wantErr == "" {
				require.NoError(t, err)
				assert.Equal(t, "deployer", resp.GetServiceAccount().GetName())
				return
			}
			require.Error(t, err)
			if tt.sentinel == errdefs.ErrPermissionDenied {
				assert.EqualError(t, err, tt.wantErr)
			} else {
				assert.ErrorContains(t, err, tt.wantErr)
			}
			assert.ErrorIs(t, err, tt.sentinel)
			assert.Nil(t, resp)
			assert.Empty(t, tokens.Calls(), "a refused request must not reach the TokenRequest API")
			assert.Empty(t, grants.Keys(), "a refused request must not create a grant")
		})
	}
}

// Each review asks as the ServiceAccount itself, with the groups every
// ServiceAccount token carries, and asks every escalation once.
func TestEscalationReviewsAsTheServiceAccount(t *testing.T) {
	access := allowing()
	m, _ := escalationMinter(t, &fakeTokens{}, access, nil, nil)
	_, err := m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref("apps", "deployer")})
	require.NoError(t, err)
	var asked []authorizationv1.ResourceAttributes
	for _, r := range access.Reviews() {
		assert.Equal(t, "system:serviceaccount:apps:deployer", r.User)
		assert.Equal(t, "uid-apps-deployer", r.UID)
		assert.Equal(t, []string{"system:serviceaccounts", "system:serviceaccounts:apps", "system:authenticated"}, r.Groups)
		assert.Nil(t, r.NonResourceAttributes)
		require.NotNil(t, r.ResourceAttributes)
		asked = append(asked, *r.ResourceAttributes)
	}
	assert.ElementsMatch(t, []authorizationv1.ResourceAttributes{tokenAny, tokenOwn, impNS, impUsers}, asked)
}

// The answers for a ServiceAccount are kept for the TTL, by the injected
// clock, and then asked again: a role granted since is seen. Failures are
// not kept.
func TestEscalationAnswersAreCached(t *testing.T) {
	clk := testingclock.NewFakeClock(issuedAt)
	access := allowing()
	m, _ := escalationMinter(t, &fakeTokens{}, access, nil, clk)
	mint := func() error {
		_, err := m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref("apps", "deployer")})
		return err
	}
	n := len(escalations)

	require.NoError(t, mint())
	require.NoError(t, mint())
	assert.Len(t, access.Reviews(), n, "a second mint within the TTL asked again")

	access.set(tokenAny)
	clk.Step(DefaultEscalationTTL - time.Second)
	require.NoError(t, mint(), "within the TTL, the cached answer holds")
	assert.Len(t, access.Reviews(), n)

	clk.Step(time.Second)
	require.ErrorIs(t, mint(), errdefs.ErrPermissionDenied, "past the TTL, the new role is seen")
	assert.Len(t, access.Reviews(), 2*n)
	require.ErrorIs(t, mint(), errdefs.ErrPermissionDenied, "a refusal is cached too")
	assert.Len(t, access.Reviews(), 2*n)

	clk.Step(DefaultEscalationTTL)
	access.mu.Lock()
	access.err = apierrors.NewServiceUnavailable("overloaded")
	access.mu.Unlock()
	require.ErrorIs(t, mint(), errdefs.ErrUnavailable)
	after := len(access.Reviews())
	require.ErrorIs(t, mint(), errdefs.ErrUnavailable)
	assert.Greater(t, len(access.Reviews()), after, "a failure was cached")
}

// Concurrent mints for one ServiceAccount share one set of reviews.
func TestEscalationReviewsAreShared(t *testing.T) {
	clk := testingclock.NewFakeClock(issuedAt)
	access := allowing()
	access.gate = make(chan struct{})
	m, _ := escalationMinter(t, &fakeTokens{}, access, nil, clk)
	const mints = 20
	errs := make(chan error, mints)
	for range mints {
		go func() {
			_, err := m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref("apps", "deployer")})
			errs <- err
		}()
	}
	require.Eventually(t, func() bool { return len(access.Reviews()) == len(escalations) }, 10*time.Second, time.Millisecond)
	close(access.gate)
	for range mints {
		require.NoError(t, <-errs)
	}
	assert.Len(t, access.Reviews(), len(escalations), "%d concurrent mints asked more than once", mints)
}

// A mint whose context ends while it waits for the reviews fails with the
// context's error, and leaves the reviews to the others.
func TestEscalationWaitEndsWithContext(t *testing.T) {
	access := allowing()
	access.gate = make(chan struct{})
	defer close(access.gate)
	m, _ := escalationMinter(t, &fakeTokens{}, access, nil, nil)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		_, err := m.Mint(ctx, fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref("apps", "deployer")})
		done <- err
	}()
	require.Eventually(t, func() bool { return len(access.Reviews()) == len(escalations) }, 10*time.Second, time.Millisecond)
	cancel()
	err := <-done
	require.ErrorIs(t, err, context.Canceled)
	assert.NotErrorIs(t, err, errdefs.ErrPermissionDenied)
	assert.ErrorContains(t, err, "ask the spoke API server whether ServiceAccount apps/deployer may escalate: ")
}

func TestNewValidatesEscalationConfig(t *testing.T) {
	tests := []struct {
		name    string
		allowed []types.NamespacedName
		ttl     time.Duration
		wantErr string
	}{
		{name: "valid", allowed: []types.NamespacedName{{Namespace: "apps", Name: "deployer"}, {Namespace: "ci", Name: "*"}}},
		{name: "no namespace", allowed: []types.NamespacedName{{Name: "deployer"}},
			wantErr: `spoke config: allowed escalating ServiceAccount "/deployer": namespace "": `},
		{name: "every namespace", allowed: []types.NamespacedName{{Namespace: "*", Name: "*"}},
			wantErr: `spoke config: allowed escalating ServiceAccount "*/*": namespace "*": `},
		{name: "no name", allowed: []types.NamespacedName{{Namespace: "apps"}},
			wantErr: `spoke config: allowed escalating ServiceAccount "apps/": name "" is neither a ServiceAccount name nor *: `},
		{name: "a pattern", allowed: []types.NamespacedName{{Namespace: "apps", Name: "deploy*"}},
			wantErr: `name "deploy*" is neither a ServiceAccount name nor *`},
		{name: "negative TTL", ttl: -time.Second, wantErr: "spoke config: EscalationTTL -1s is negative"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			grants := newFakeGrants()
			_, err := New(withGrants(Config{Tokens: &fakeTokens{}, ServiceAccounts: lister(t), Access: allowing(),
				AllowEscalating: tt.allowed, EscalationTTL: tt.ttl}, grants))
			if tt.wantErr == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tt.wantErr)
		})
	}
}

func TestParseAllowEscalating(t *testing.T) {
	tests := []struct {
		in      string
		want    types.NamespacedName
		wantErr string
	}{
		{in: "apps/deployer", want: types.NamespacedName{Namespace: "apps", Name: "deployer"}},
		{in: "ci/*", want: types.NamespacedName{Namespace: "ci", Name: "*"}},
		{in: "deployer", wantErr: `"deployer": want namespace/name or namespace/*`},
		{in: "", wantErr: `"": want namespace/name or namespace/*`},
		{in: "apps/a/b", wantErr: `name "a/b" is neither a ServiceAccount name nor *`},
		{in: "*/deployer", wantErr: `namespace "*"`},
		{in: "Apps/deployer", wantErr: `namespace "Apps"`},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := ParseAllowEscalating(tt.in)
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
		})
	}
}
