package spoke

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

var secretsResource = schema.GroupResource{Resource: "secrets"}

// fakeGrants is a GrantStore over a map, as the API server would keep
// Secrets, with the grant informer's cache: each write reaches cache, and
// events (once set) as the informer would call it, unless lag is set. Its
// ListCredential returns every Secret it holds, whatever its type, as a
// store that did not filter would; and so does its cache.
type fakeGrants struct {
	createErr, patchErr, deleteErr, listErr error

	cache *countingIndexer

	mu      sync.Mutex
	n       int
	secrets map[string]*corev1.Secret // by namespace/name
	deleted []string
	deletes int
	lookups []string
	lag     bool                       // writes do not reach cache
	events  cache.ResourceEventHandler // the Minter's GrantEvents, once set
}

func newFakeGrants(existing ...*corev1.Secret) *fakeGrants {
	f := &fakeGrants{
		secrets: map[string]*corev1.Secret{},
		cache:   &countingIndexer{Indexer: cache.NewIndexer(cache.MetaNamespaceKeyFunc, GrantIndexers())},
	}
	for _, s := range existing {
		f.secrets[s.Namespace+"/"+s.Name] = s.DeepCopy()
		if err := f.cache.Add(s.DeepCopy()); err != nil {
			panic(err)
		}
	}
	return f
}

// withGrants returns cfg with grants as its store and cache.
func withGrants(cfg Config, grants *fakeGrants) Config {
	cfg.Grants, cfg.GrantCache = grants, grants.cache
	return cfg
}

// inform passes a write to the cache and the event handler, as the grant
// informer would, unless the informer lags. f.mu is held.
func (f *fakeGrants) inform(old, now *corev1.Secret) {
	if f.lag {
		return
	}
	switch {
	case old == nil:
		_ = f.cache.Add(now.DeepCopy())
		if f.events != nil {
			f.events.OnAdd(now.DeepCopy(), false)
		}
	case now == nil:
		_ = f.cache.Delete(old.DeepCopy())
		if f.events != nil {
			f.events.OnDelete(old.DeepCopy())
		}
	default:
		_ = f.cache.Update(now.DeepCopy())
		if f.events != nil {
			f.events.OnUpdate(old.DeepCopy(), now.DeepCopy())
		}
	}
}

func (f *fakeGrants) Create(_ context.Context, grant *corev1.Secret) (*corev1.Secret, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.createErr != nil {
		return nil, f.createErr
	}
	f.n++
	s := grant.DeepCopy()
	s.Name = fmt.Sprintf("%s%d", s.GenerateName, f.n)
	s.UID = types.UID(fmt.Sprintf("grant-uid-%d", f.n))
	f.secrets[s.Namespace+"/"+s.Name] = s
	f.inform(nil, s)
	return s.DeepCopy(), nil
}

func (f *fakeGrants) Patch(_ context.Context, namespace, name string, patch []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.patchErr != nil {
		return f.patchErr
	}
	s, ok := f.secrets[namespace+"/"+name]
	if !ok {
		return apierrors.NewNotFound(secretsResource, name)
	}
	old := s.DeepCopy()
	var p struct {
		Metadata struct {
			UID                 types.UID
			Labels, Annotations map[string]string
		}
	}
	if err := json.Unmarshal(patch, &p); err != nil {
		return err
	}
	if p.Metadata.UID != "" && p.Metadata.UID != s.UID {
		return apierrors.NewConflict(secretsResource, name, errors.New("precondition failed: UID"))
	}
	if s.Labels == nil {
		s.Labels = map[string]string{}
	}
	if s.Annotations == nil {
		s.Annotations = map[string]string{}
	}
	maps.Copy(s.Labels, p.Metadata.Labels)
	maps.Copy(s.Annotations, p.Metadata.Annotations)
	f.inform(old, s)
	return nil
}

func (f *fakeGrants) Delete(_ context.Context, namespace, name string, uid types.UID) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.deletes++
	if f.deleteErr != nil {
		return f.deleteErr
	}
	key := namespace + "/" + name
	s, ok := f.secrets[key]
	switch {
	case !ok:
		return apierrors.NewNotFound(secretsResource, name)
	case s.UID != uid:
		return apierrors.NewConflict(secretsResource, name, errors.New("precondition failed: UID"))
	}
	delete(f.secrets, key)
	f.deleted = append(f.deleted, key)
	f.inform(s, nil)
	return nil
}

func (f *fakeGrants) ListCredential(_ context.Context, credentialID string) ([]corev1.Secret, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.lookups = append(f.lookups, credentialID)
	if f.listErr != nil {
		return nil, f.listErr
	}
	var out []corev1.Secret
	for _, s := range f.secrets {
		out = append(out, *s.DeepCopy())
	}
	return out, nil
}

// Lookups returns the credential ids ListCredential was asked for.
func (f *fakeGrants) Lookups() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.lookups)
}

// SALists returns the ServiceAccounts whose grants were read from the
// cache's index.
func (f *fakeGrants) SALists() []string { return f.cache.SALists() }

// Keys returns the namespace/name of every Secret it holds, sorted.
func (f *fakeGrants) Keys() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Sorted(maps.Keys(f.secrets))
}

func (f *fakeGrants) Get(key string) *corev1.Secret {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.secrets[key].DeepCopy()
}

func (f *fakeGrants) Deleted() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.deleted)
}

// Deletes counts the calls to Delete, failed ones included.
func (f *fakeGrants) Deletes() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.deletes
}

// Lists counts the reads of the whole cache: one per sweep.
func (f *fakeGrants) Lists() int { return f.cache.Lists() }

func (f *fakeGrants) setDeleteErr(err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.deleteErr = err
}

// countingIndexer is an informer's indexer that counts what is read from
// it.
type countingIndexer struct {
	cache.Indexer

	mu      sync.Mutex
	lists   int
	saLists []string
}

func (c *countingIndexer) List() []any {
	c.mu.Lock()
	c.lists++
	c.mu.Unlock()
	return c.Indexer.List()
}

func (c *countingIndexer) ByIndex(name, value string) ([]any, error) {
	if name == GrantServiceAccountIndex {
		c.mu.Lock()
		c.saLists = append(c.saLists, value)
		c.mu.Unlock()
	}
	return c.Indexer.ByIndex(name, value)
}

func (c *countingIndexer) Lists() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lists
}

func (c *countingIndexer) SALists() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.saLists)
}

func TestMintBindsTokenToGrant(t *testing.T) {
	tokens := &fakeTokens{}
	grants := newFakeGrants()
	m, err := New(Config{
		Tokens:          tokens,
		Grants:          grants,
		GrantCache:      grants.cache,
		ServiceAccounts: lister(t, withAudiences(serviceAccount("apps", "deployer", argocd), "vault")),
	})
	require.NoError(t, err)

	cluster := admitted("fleet/spoke-1")
	cluster.UID = "uid-spoke-1"
	sub := subject(argocd)
	sub.Groups = []string{"system:serviceaccounts", "team,a", "100%"}
	resp, err := m.Mint(t.Context(), cluster, &credbrokerv1alpha1.MintRequest{Subject: sub, Audiences: []string{"vault"}, ExpirationSeconds: 900})
	require.NoError(t, err)
	require.NotEmpty(t, resp.GetToken())

	require.Equal(t, []string{"apps/credbroker-grant-1"}, grants.Keys())
	grant := grants.Get("apps/credbroker-grant-1")
	assert.Equal(t, GrantType, grant.Type)
	assert.Empty(t, grant.Data)
	assert.Empty(t, grant.StringData)
	assert.Equal(t, map[string]string{
		GrantLabel:               "true",
		GrantServiceAccountLabel: "deployer",
		GrantJTILabel:            "jti-apps-deployer",
	}, grant.Labels)
	assert.Equal(t, map[string]string{
		GrantServiceAccountAnnotation:    "deployer",
		GrantHubUserAnnotation:           argocd,
		GrantHubUIDAnnotation:            "hub-uid",
		GrantHubGroupsAnnotation:         "system:serviceaccounts,team%2Ca,100%25",
		GrantClusterProfileAnnotation:    "fleet/spoke-1",
		GrantClusterProfileUIDAnnotation: "uid-spoke-1",
		GrantAudiencesAnnotation:         "vault",
		GrantExpirationAnnotation:        issuedAt.Add(900 * time.Second).Format(time.RFC3339),
		GrantCredentialIDAnnotation:      "JTI=jti-apps-deployer",
		// The API proxy forwards the token only if it hashes to this.
		GrantTokenSHA256Annotation: hex.EncodeToString(sha256Of(resp.GetToken())),
	}, grant.Annotations)
	assert.Equal(t, sub.Groups, splitGroups(grant.Annotations[GrantHubGroupsAnnotation]))

	calls := tokens.Calls()
	require.Len(t, calls, 1)
	assert.Equal(t, &authenticationv1.BoundObjectReference{
		APIVersion: "v1", Kind: "Secret", Name: "credbroker-grant-1", UID: "grant-uid-1",
	}, calls[0].req.Spec.BoundObjectRef, "the token must be bound to its grant")
}

// The attack: the agent cannot create a grant (RBAC, admission, an API
// server error) and hands out an unbound token, which nothing can revoke.
func TestMintRefusesWithoutGrant(t *testing.T) {
	forbidden := apierrors.NewForbidden(secretsResource, "", errors.New(`User "agent" cannot create resource "secrets"`))
	canceled, cancel := context.WithCancel(t.Context())
	cancel()
	tests := []struct {
		name     string
		ctx      context.Context
		err      error
		wantErr  string
		sentinel error
	}{
		{
			name: "forbidden",
			ctx:  t.Context(),
			err:  forbidden,
			wantErr: "spoke API server forbids the agent to create the grant Secret the token would be bound to in namespace apps, so no token is minted; " +
				"grant the agent's ServiceAccount create on secrets and check the credbroker-agent-grants admission policy: " +
				`secrets is forbidden: User "agent" cannot create resource "secrets": unavailable`,
			sentinel: errdefs.ErrUnavailable,
		},
		{
			name:     "API server error",
			ctx:      t.Context(),
			err:      apierrors.NewInternalError(errors.New("etcd is down")),
			wantErr:  "create the grant Secret the token would be bound to in namespace apps, so no token is minted: Internal error occurred: etcd is down: unavailable",
			sentinel: errdefs.ErrUnavailable,
		},
		{
			name:     "canceled",
			ctx:      canceled,
			err:      fmt.Errorf("post: %w", context.Canceled),
			wantErr:  "create the grant Secret the token would be bound to in namespace apps: post: context canceled",
			sentinel: context.Canceled,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tokens := &fakeTokens{}
			grants := newFakeGrants()
			grants.createErr = tt.err
			m, err := New(Config{Tokens: tokens, Grants: grants, GrantCache: grants.cache, ServiceAccounts: lister(t, serviceAccount("apps", "deployer", argocd))})
			require.NoError(t, err)
			resp, err := m.Mint(tt.ctx, fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject(argocd)})
			requireRefused(t, tokens, resp, err, tt.wantErr, tt.sentinel)
		})
	}
}

func TestMintDeletesGrantOfFailedMint(t *testing.T) {
	tests := []struct {
		name     string
		tokens   *fakeTokens
		patchErr error
		wantErr  string
	}{
		{
			name:    "TokenRequest fails",
			tokens:  &fakeTokens{err: apierrors.NewInternalError(errors.New("boom"))},
			wantErr: "mint token for spoke ServiceAccount apps/deployer: Internal error occurred: boom: unavailable",
		},
		{
			name:    "no token",
			tokens:  &fakeTokens{empty: true},
			wantErr: "spoke API server returned no token for ServiceAccount apps/deployer: unavailable",
		},
		{
			name:     "credential id not recorded",
			tokens:   &fakeTokens{},
			patchErr: apierrors.NewInternalError(errors.New("boom")),
			wantErr:  "record credential id JTI=jti-apps-deployer on grant apps/credbroker-grant-1: Internal error occurred: boom: unavailable",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			grants := newFakeGrants()
			grants.patchErr = tt.patchErr
			m, err := New(Config{Tokens: tt.tokens, Grants: grants, GrantCache: grants.cache, ServiceAccounts: lister(t, serviceAccount("apps", "deployer", argocd))})
			require.NoError(t, err)
			resp, err := m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject(argocd)})
			require.EqualError(t, err, tt.wantErr)
			assert.ErrorIs(t, err, errdefs.ErrUnavailable)
			assert.Nil(t, resp)
			assert.Equal(t, []string{"apps/credbroker-grant-1"}, grants.Deleted())
			assert.Empty(t, grants.Keys())
		})
	}
}

// grantSecret is a Secret of typ as the agent writes a grant before its
// token is minted, with expiration as its GrantExpirationAnnotation (none
// if empty).
func grantSecret(namespace, name string, typ corev1.SecretType, expiration string, created time.Time) *corev1.Secret {
	s := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: namespace, Name: name, UID: types.UID("uid-" + name),
			Labels:            map[string]string{GrantLabel: "true", GrantServiceAccountLabel: ""},
			Annotations:       map[string]string{},
			CreationTimestamp: metav1.NewTime(created),
		},
		Type: typ,
	}
	for _, k := range grantAnnotations {
		s.Annotations[k] = ""
	}
	delete(s.Annotations, GrantExpirationAnnotation)
	if expiration != "" {
		s.Annotations[GrantExpirationAnnotation] = expiration
	}
	return s
}

// startRun runs m.Run until the test ends and waits for its first sweep.
func startRun(t *testing.T, m *Minter, grants *fakeGrants, clk *testingclock.FakeClock) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		assert.NoError(t, <-done)
	})
	require.Eventually(t, func() bool { return grants.Lists() >= 1 && clk.HasWaiters() }, 5*time.Second, time.Millisecond, "Run never swept")
}

func TestRunCollectsGrantWhenTokenExpires(t *testing.T) {
	clk := testingclock.NewFakeClock(issuedAt)
	grants := newFakeGrants()
	m, err := New(Config{Tokens: &fakeTokens{}, Grants: grants, GrantCache: grants.cache, Clock: clk, CollectInterval: time.Hour,
		ServiceAccounts: lister(t, serviceAccount("apps", "deployer", argocd))})
	require.NoError(t, err)
	startRun(t, m, grants, clk)

	_, err = m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ExpirationSeconds: 900})
	require.NoError(t, err)
	require.Equal(t, []string{"apps/credbroker-grant-1"}, grants.Keys())

	clk.Step(899 * time.Second)
	assert.Empty(t, grants.Deleted(), "a grant of a live token must stay")
	clk.Step(time.Second)
	require.Eventually(t, func() bool { return len(grants.Keys()) == 0 }, 5*time.Second, time.Millisecond,
		"the grant outlived its token")
	assert.Equal(t, []string{"apps/credbroker-grant-1"}, grants.Deleted())
}

// A TokenRequest answer without an expiration must not revoke the token it
// carries at once: its grant lives for the lifetime that was asked for.
func TestGrantOfTokenWithoutExpirationLivesItsRequestedLifetime(t *testing.T) {
	clk := testingclock.NewFakeClock(issuedAt)
	grants := newFakeGrants()
	m, err := New(Config{Tokens: &fakeTokens{noExp: true}, Grants: grants, GrantCache: grants.cache, Clock: clk, CollectInterval: time.Hour,
		ServiceAccounts: lister(t, serviceAccount("apps", "deployer", argocd))})
	require.NoError(t, err)
	startRun(t, m, grants, clk)

	_, err = m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ExpirationSeconds: 900})
	require.NoError(t, err)
	clk.Step(time.Second)
	assert.Equal(t, []string{"apps/credbroker-grant-1"}, grants.Keys(), "the grant of a live token was collected")
	assert.Equal(t, issuedAt.Add(900*time.Second).UTC().Format(time.RFC3339),
		grants.secrets["apps/credbroker-grant-1"].Annotations[GrantExpirationAnnotation])
	clk.Step(899 * time.Second)
	require.Eventually(t, func() bool { return len(grants.Keys()) == 0 }, 5*time.Second, time.Millisecond)
}

func TestRunSweepsExpiredGrants(t *testing.T) {
	clk := testingclock.NewFakeClock(issuedAt)
	grants := newFakeGrants(
		// Left over from an agent that crashed.
		grantSecret("apps", "expired", GrantType, issuedAt.Add(-time.Second).Format(time.RFC3339), issuedAt.Add(-time.Hour)),
		grantSecret("apps", "expires-now", GrantType, issuedAt.Format(time.RFC3339), issuedAt.Add(-time.Hour)),
		grantSecret("apps", "live", GrantType, issuedAt.Add(30*time.Minute).Format(time.RFC3339), issuedAt),
		// No expiration the agent would write: someone else changed them.
		grantSecret("apps", "garbled-old", GrantType, "tomorrow", issuedAt.Add(-2*time.Hour)),
		grantSecret("apps", "garbled-new", GrantType, "", issuedAt.Add(-10*time.Minute)),
		// Not grants, whatever their labels say: never touched.
		grantSecret("apps", "db-password", corev1.SecretTypeOpaque, issuedAt.Add(-time.Hour).Format(time.RFC3339), issuedAt.Add(-2*time.Hour)),
		grantSecret("apps", "sa-token", corev1.SecretTypeServiceAccountToken, "", issuedAt.Add(-2*time.Hour)),
	)
	delete(grants.secrets["apps/garbled-new"].Annotations, GrantExpirationAnnotation)
	m, err := New(Config{Tokens: &fakeTokens{}, Grants: grants, GrantCache: grants.cache, Clock: clk, CollectInterval: time.Minute,
		ServiceAccounts: lister(t, serviceAccount("apps", "deployer", argocd))})
	require.NoError(t, err)
	startRun(t, m, grants, clk)

	// The first sweep runs at start-up; it queues the garbled grants for
	// deletion as changed by someone else.
	require.Eventually(t, func() bool { return len(grants.Keys()) == 3 }, 5*time.Second, time.Millisecond)
	assert.Equal(t, []string{"apps/db-password", "apps/live", "apps/sa-token"}, grants.Keys())

	// live's expiry is at 30m; it goes at the first sweep after it.
	for range 30 {
		clk.Step(time.Minute)
	}
	require.Eventually(t, func() bool { return !slices.Contains(grants.Keys(), "apps/live") }, 5*time.Second, time.Millisecond)
	assert.Equal(t, []string{"apps/db-password", "apps/sa-token"}, grants.Keys())
}

func TestRunRetriesAfterDeleteFails(t *testing.T) {
	clk := testingclock.NewFakeClock(issuedAt)
	grants := newFakeGrants(grantSecret("apps", "expired", GrantType, issuedAt.Add(-time.Second).Format(time.RFC3339), issuedAt.Add(-time.Hour)))
	grants.deleteErr = apierrors.NewInternalError(errors.New("boom"))
	m, err := New(withGrants(Config{Tokens: &fakeTokens{}, Clock: clk,
		ServiceAccounts: lister(t, serviceAccount("apps", "deployer", argocd))}, grants))
	require.NoError(t, err)
	startRun(t, m, grants, clk)
	// The sweep hands the expired grant to the deleter, which tries once.
	require.Eventually(t, func() bool { return grants.Deletes() == 1 }, 5*time.Second, time.Millisecond)
	assert.Equal(t, []string{"apps/expired"}, grants.Keys())

	grants.setDeleteErr(nil)
	clk.Step(DefaultCollectInterval)
	require.Eventually(t, func() bool { return len(grants.Keys()) == 0 }, 5*time.Second, time.Millisecond)
}

// A sweep that cannot revoke a grant its ServiceAccount no longer allows
// says so, once per failed grant, so a spoke admin learns that a token
// withdrawn from a hub subject still works; a revoke that succeeds logs
// no failure.
func TestSweepLogsARevokeThatFails(t *testing.T) {
	tests := []struct {
		name     string
		delErr   error
		wantLine string
		failures int
	}{
		{name: "delete fails", delErr: apierrors.NewInternalError(errors.New("boom")), wantLine: "failed to revoke a grant its ServiceAccount no longer allows", failures: 1},
		{name: "delete succeeds", wantLine: `"revoked grant"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clk := testingclock.NewFakeClock(issuedAt)
			// apps/deployer allows argocd only: the grant of flux goes.
			grants := newFakeGrants(grantOf("apps", "flux-default", "deployer", flux, ""))
			grants.deleteErr = tt.delErr
			var (
				mu    sync.Mutex
				lines strings.Builder
			)
			log := funcr.New(func(_, args string) {
				mu.Lock()
				defer mu.Unlock()
				lines.WriteString(args + "\n")
			}, funcr.Options{})
			logged := func() string { mu.Lock(); defer mu.Unlock(); return lines.String() }
			m, err := New(withGrants(Config{Tokens: &fakeTokens{}, Clock: clk, Log: log,
				ServiceAccounts: lister(t, serviceAccount("apps", "deployer", argocd))}, grants))
			require.NoError(t, err)
			startRun(t, m, grants, clk)

			require.Eventually(t, func() bool { return strings.Contains(logged(), tt.wantLine) }, 5*time.Second, time.Millisecond)
			assert.Equal(t, tt.failures, strings.Count(logged(), "failed to revoke"))
		})
	}
}

// inFlightTokens is a TokenCreator that reads the grant a token is bound to
// while the token is minted, as a sweep of Run could at that moment.
type inFlightTokens struct {
	fakeTokens
	grants     *fakeGrants
	expiration string
}

func (f *inFlightTokens) CreateToken(ctx context.Context, namespace, name string, req *authenticationv1.TokenRequest) (*authenticationv1.TokenRequest, error) {
	f.expiration = f.grants.Get(namespace + "/" + req.Spec.BoundObjectRef.Name).Annotations[GrantExpirationAnnotation]
	return f.fakeTokens.CreateToken(ctx, namespace, name, req)
}

// A grant is created before its token, and a sweep may read it before the
// mint records the token's expiry: until then it says the latest the token
// can expire, not a time a sweep would collect it at, which would revoke
// the token being handed out.
func TestGrantInFlightCarriesTheLatestExpiry(t *testing.T) {
	grants := newFakeGrants()
	tokens := &inFlightTokens{grants: grants}
	m, err := New(withGrants(Config{Tokens: tokens, Clock: testingclock.NewFakeClock(issuedAt),
		ServiceAccounts: lister(t, serviceAccount("apps", "deployer", argocd))}, grants))
	require.NoError(t, err)
	_, err = m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ExpirationSeconds: 900})
	require.NoError(t, err)
	assert.Equal(t, issuedAt.Add(900*time.Second).Format(time.RFC3339), tokens.expiration)
}

// The grant of a failed mint that cannot be deleted is logged, since it
// lives until it expires; one already gone is not.
func TestMintLogsAGrantItCannotDelete(t *testing.T) {
	tests := []struct {
		name   string
		delErr error
		logged bool
	}{
		{name: "delete fails", delErr: apierrors.NewInternalError(errors.New("boom")), logged: true},
		{name: "already gone", delErr: apierrors.NewNotFound(secretsResource, "credbroker-grant-1")},
		{name: "deleted"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			grants := newFakeGrants()
			grants.deleteErr = tt.delErr
			log, lines := capture()
			m, err := New(withGrants(Config{Tokens: &fakeTokens{err: apierrors.NewInternalError(errors.New("mint failed"))}, Log: log,
				ServiceAccounts: lister(t, serviceAccount("apps", "deployer", argocd))}, grants))
			require.NoError(t, err)
			_, err = m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject(argocd)})
			require.ErrorIs(t, err, errdefs.ErrUnavailable)
			assert.Equal(t, tt.logged, strings.Contains(lines.String(), "failed to delete the grant of a failed mint"))
		})
	}
}

func sha256Of(s string) []byte {
	sum := sha256.Sum256([]byte(s))
	return sum[:]
}
