package spoke

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	corev1listers "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// cachedServiceAccounts is an informer's cache of sas that a test updates,
// as the informer would on a watch event.
func cachedServiceAccounts(t *testing.T, sas ...*corev1.ServiceAccount) (cache.Indexer, corev1listers.ServiceAccountLister) {
	t.Helper()
	indexer := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
	for _, sa := range sas {
		require.NoError(t, indexer.Add(sa))
	}
	return indexer, corev1listers.NewServiceAccountLister(indexer)
}

// policySA is apps/<name> allowing subjects and audiences.
func policySA(name, subjects, audiences string) *corev1.ServiceAccount {
	sa := serviceAccount("apps", name, subjects)
	if audiences != "" {
		sa = withAudiences(sa, audiences)
	}
	return sa
}

// grantOf is a live grant of the ServiceAccount namespace/sa for user.
func grantOf(namespace, name, sa, user, audiences string) *corev1.Secret {
	return &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: namespace, Name: name, UID: types.UID("uid-" + name),
			Labels: map[string]string{GrantLabel: "true", GrantServiceAccountLabel: sa, GrantJTILabel: "jti-" + name},
			Annotations: map[string]string{
				GrantServiceAccountAnnotation:    sa,
				GrantHubUserAnnotation:           user,
				GrantHubUIDAnnotation:            "",
				GrantHubGroupsAnnotation:         "",
				GrantClusterProfileAnnotation:    "",
				GrantClusterProfileUIDAnnotation: "",
				GrantAudiencesAnnotation:         audiences,
				GrantCredentialIDAnnotation:      "JTI=jti-" + name,
				GrantExpirationAnnotation:        issuedAt.Add(30 * time.Minute).Format(time.RFC3339),
			},
		},
		Type: GrantType,
	}
}

// deployerGrants are the grants of apps/deployer, and Secrets that are not
// its grants.
func deployerGrants() []*corev1.Secret {
	notAGrant := grantOf("apps", "db-password", "deployer", argocd, "")
	notAGrant.Type = corev1.SecretTypeOpaque
	return []*corev1.Secret{
		grantOf("apps", "argocd-default", "deployer", argocd, ""),
		grantOf("apps", "flux-vault", "deployer", flux, "vault"),
		grantOf("apps", "flux-sts", "deployer", flux, "sts"),
		// Another ServiceAccount's, and the same name in another namespace.
		grantOf("apps", "other-sa", "reader", argocd, "vault"),
		grantOf("tools", "other-ns", "deployer", argocd, "vault"),
		// Not grants, whatever their annotations say: never touched.
		notAGrant,
	}
}

// The attack: a spoke admin withdraws a hub subject's opt-in, or an
// audience, and the tokens already minted under it keep working.
func TestReconcileRevokesWhatPolicyNoLongerAllows(t *testing.T) {
	untouched := []string{"apps/db-password", "apps/other-sa", "tools/other-ns"}
	tests := []struct {
		name    string
		sa      *corev1.ServiceAccount // apps/deployer now; nil: deleted
		revoked []string
	}{
		{
			name: "nothing withdrawn",
			sa:   policySA("deployer", argocd+","+flux, "vault,sts"),
		},
		{
			name:    "subject removed",
			sa:      policySA("deployer", flux, "vault,sts"),
			revoked: []string{"apps/argocd-default"},
		},
		{
			name:    "audience removed",
			sa:      policySA("deployer", argocd+","+flux, "sts"),
			revoked: []string{"apps/flux-vault"},
		},
		{
			name:    "audience annotation removed: only the default audiences stay",
			sa:      policySA("deployer", argocd+","+flux, ""),
			revoked: []string{"apps/flux-sts", "apps/flux-vault"},
		},
		{
			name:    "opt-in removed",
			sa:      policySA("deployer", "", "vault,sts"),
			revoked: []string{"apps/argocd-default", "apps/flux-sts", "apps/flux-vault"},
		},
		{
			name:    "the subject's group listed instead of its name allows nothing",
			sa:      policySA("deployer", "system:serviceaccounts,"+flux, "vault,sts"),
			revoked: []string{"apps/argocd-default"},
		},
		{
			name:    "a subject that differs only in case is another subject",
			sa:      policySA("deployer", strings.ToUpper(argocd)+","+flux, "vault,sts"),
			revoked: []string{"apps/argocd-default"},
		},
		{
			name: "ServiceAccount deleted: its tokens died with it",
			sa:   nil,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sas := []*corev1.ServiceAccount{policySA("reader", "", "")}
			if tt.sa != nil {
				sas = append(sas, tt.sa)
			}
			_, sal := cachedServiceAccounts(t, sas...)
			grants := newFakeGrants(deployerGrants()...)
			before := grants.Keys()
			m, err := New(Config{Tokens: &fakeTokens{}, Grants: grants, GrantCache: grants.cache, ServiceAccounts: sal})
			require.NoError(t, err)

			require.NoError(t, m.Reconcile(t.Context(), "apps", "deployer"))
			assert.ElementsMatch(t, tt.revoked, grants.Deleted())
			for _, k := range untouched {
				assert.Contains(t, grants.Keys(), k)
			}
			assert.Len(t, grants.Keys(), len(before)-len(tt.revoked))
			if tt.sa == nil {
				assert.Empty(t, grants.SALists(), "a deleted ServiceAccount needs no list")
			} else {
				assert.Equal(t, []string{"apps/deployer"}, grants.SALists(), "only the ServiceAccount's grants are listed")
			}
			assert.Zero(t, grants.Lists(), "no read of every grant")
			assert.Empty(t, grants.Lookups(), "no API list")
		})
	}
}

func TestReconcileLogsCredentialID(t *testing.T) {
	log, lines := capture()
	_, sal := cachedServiceAccounts(t, policySA("deployer", flux, "vault"))
	grants := newFakeGrants(deployerGrants()...)
	m, err := New(Config{Tokens: &fakeTokens{}, Grants: grants, GrantCache: grants.cache, ServiceAccounts: sal, Log: log})
	require.NoError(t, err)
	require.NoError(t, m.Reconcile(t.Context(), "apps", "deployer"))
	assert.Equal(t,
		`"level"=0 "msg"="revoked grant" "grant"="apps/argocd-default" "credentialID"="JTI=jti-argocd-default" "subject"="`+argocd+`" "serviceAccount"="apps/deployer" "audiences"=[] "reason"="the ServiceAccount no longer allows the hub user"`+"\n"+
			`"level"=0 "msg"="revoked grant" "grant"="apps/flux-sts" "credentialID"="JTI=jti-flux-sts" "subject"="`+flux+`" "serviceAccount"="apps/deployer" "audiences"=["sts"] "reason"="the ServiceAccount no longer allows an audience of the token"`+"\n",
		sortedLines(lines.String()))
}

// sortedLines returns the lines of s sorted, as revocations run in the
// store's order.
func sortedLines(s string) string {
	lines := slices.Collect(strings.Lines(s))
	slices.Sort(lines)
	return strings.Join(lines, "")
}

func TestReconcileErrors(t *testing.T) {
	boom := apierrors.NewInternalError(errors.New("boom"))
	tests := []struct {
		name    string
		delErr  error
		wantErr string
	}{
		{
			name:    "delete fails",
			delErr:  boom,
			wantErr: "revoke grant apps/argocd-default, which spoke ServiceAccount apps/deployer no longer allows: Internal error occurred: boom: unavailable",
		},
		{
			name:   "already gone",
			delErr: apierrors.NewNotFound(secretsResource, "argocd-default"),
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, sal := cachedServiceAccounts(t, policySA("deployer", flux, "vault,sts"))
			grants := newFakeGrants(deployerGrants()...)
			grants.deleteErr = tt.delErr
			m, err := New(Config{Tokens: &fakeTokens{}, Grants: grants, GrantCache: grants.cache, ServiceAccounts: sal})
			require.NoError(t, err)
			err = m.Reconcile(t.Context(), "apps", "deployer")
			if tt.wantErr == "" {
				require.NoError(t, err)
				return
			}
			require.EqualError(t, err, tt.wantErr)
			assert.ErrorIs(t, err, errdefs.ErrUnavailable)
		})
	}
}

func TestPolicyChangedQueuesOnlyPolicyChanges(t *testing.T) {
	old := policySA("deployer", argocd, "vault")
	tests := []struct {
		name   string
		change func(sa *corev1.ServiceAccount)
		queued bool
	}{
		{name: "unrelated annotation", change: func(sa *corev1.ServiceAccount) { sa.Annotations["owner"] = "team-a" }},
		{name: "labels", change: func(sa *corev1.ServiceAccount) { sa.Labels = map[string]string{"a": "b"} }},
		{name: "subjects", change: func(sa *corev1.ServiceAccount) { sa.Annotations[AllowedSubjectsAnnotation] = flux }, queued: true},
		{name: "audiences", change: func(sa *corev1.ServiceAccount) { delete(sa.Annotations, AllowedAudiencesAnnotation) }, queued: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := newMinter(t, &fakeTokens{})
			now := old.DeepCopy()
			tt.change(now)
			// Before Run, nothing is queued: Run's first sweep checks
			// every grant.
			m.PolicyChanged(old, now)
			require.Nil(t, m.queue)
			m.queue = newPolicyQueue() // as Run starts it
			t.Cleanup(m.queue.ShutDown)
			m.PolicyChanged(old, now)
			m.PolicyChanged(old, now) // a burst is reconciled once
			m.PolicyChanged(nil, now)
			if tt.queued {
				assert.Equal(t, 1, m.queue.Len())
			} else {
				assert.Zero(t, m.queue.Len())
			}
		})
	}
}

// Run revokes, off the caller's goroutine, the grants a policy change
// withdraws, retrying when the spoke API server fails.
func TestRunRevokesOnPolicyChange(t *testing.T) {
	clk := testingclock.NewFakeClock(issuedAt)
	old := policySA("deployer", argocd+","+flux, "")
	indexer, sal := cachedServiceAccounts(t, old, policySA("reader", argocd, ""))
	grants := newFakeGrants()
	m, err := New(Config{Tokens: &fakeTokens{}, Grants: grants, GrantCache: grants.cache, Clock: clk, CollectInterval: time.Hour, ServiceAccounts: sal})
	require.NoError(t, err)
	startRun(t, m, grants, clk)
	for _, req := range []*credbrokerv1alpha1.MintRequest{
		{Subject: subject(argocd), ServiceAccount: ref("apps", "deployer")},
		{Subject: subject(flux), ServiceAccount: ref("apps", "deployer")},
		{Subject: subject(argocd), ServiceAccount: ref("apps", "reader")},
	} {
		_, err := m.Mint(t.Context(), fleet.ClusterRef{}, req)
		require.NoError(t, err)
	}
	require.Len(t, grants.Keys(), 3)
	argocdGrant := grants.Keys()[0]
	require.Equal(t, argocd, grants.Get(argocdGrant).Annotations[GrantHubUserAnnotation])

	grants.mu.Lock()
	grants.deleteErr = apierrors.NewInternalError(errors.New("boom"))
	grants.mu.Unlock()
	now := policySA("deployer", flux, "")
	require.NoError(t, indexer.Update(now))
	m.PolicyChanged(old, now)
	require.Eventually(t, func() bool { return grants.Deletes() >= 2 }, 5*time.Second, time.Millisecond, "no retry")
	grants.mu.Lock()
	grants.deleteErr = nil
	grants.mu.Unlock()
	require.Eventually(t, func() bool { return len(grants.Deleted()) == 1 }, 5*time.Second, time.Millisecond,
		"the grant of a withdrawn subject was not revoked")
	assert.Equal(t, []string{argocdGrant}, grants.Deleted())
	assert.Len(t, grants.Keys(), 2)

	// Its expiry timer is gone with it.
	m.mu.Lock()
	assert.Len(t, m.timers, 2)
	m.mu.Unlock()
}

// An agent that was down when the policy changed revokes at its first
// sweep; a grant whose ServiceAccount is gone waits for its expiry.
func TestRunSweepRevokesWhatPolicyNoLongerAllows(t *testing.T) {
	clk := testingclock.NewFakeClock(issuedAt)
	_, sal := cachedServiceAccounts(t, policySA("deployer", flux, "vault"), policySA("reader", argocd, "vault"))
	expired := grantOf("apps", "expired", "deployer", flux, "")
	expired.Annotations[GrantExpirationAnnotation] = issuedAt.Add(-time.Second).Format(time.RFC3339)
	grants := newFakeGrants(append(deployerGrants(),
		expired,
		grantOf("apps", "sa-deleted", "gone", argocd, ""),
		grantOf("apps", "no-sa", "", argocd, ""),
	)...)
	m, err := New(Config{Tokens: &fakeTokens{}, Grants: grants, GrantCache: grants.cache, Clock: clk, ServiceAccounts: sal})
	require.NoError(t, err)
	startRun(t, m, grants, clk)
	// startRun sees the sweep begin; its deletes may still be under way.
	require.Eventually(t, func() bool { return len(grants.Deleted()) >= 3 }, 5*time.Second, time.Millisecond, "the first sweep revoked too little")
	assert.ElementsMatch(t, []string{"apps/argocd-default", "apps/flux-sts", "apps/expired"}, grants.Deleted())
	assert.Equal(t, []string{"apps/db-password", "apps/flux-vault", "apps/no-sa", "apps/other-sa", "apps/sa-deleted", "tools/other-ns"}, grants.Keys())
	assert.Equal(t, 1, grants.Lists(), "one read of the cache per sweep")
	assert.Empty(t, grants.SALists())
	assert.Empty(t, grants.Lookups(), "no API list")
}

// hookGrants runs onCreate after each grant is created.
type hookGrants struct {
	*fakeGrants
	onCreate func()
}

func (h hookGrants) Create(ctx context.Context, grant *corev1.Secret) (*corev1.Secret, error) {
	s, err := h.fakeGrants.Create(ctx, grant)
	h.onCreate()
	return s, err
}

// The race: the policy changes after Mint checked it, but before its
// grant exists for Reconcile to find. Mint checks again once it does.
func TestMintRefusesWhenPolicyChangesDuringMint(t *testing.T) {
	tests := []struct {
		name     string
		now      *corev1.ServiceAccount // nil: deleted
		wantErr  string
		sentinel error
	}{
		{
			name:     "subject withdrawn",
			now:      policySA("deployer", flux, "vault"),
			wantErr:  "spoke ServiceAccount apps/deployer changed its policy while the token was minted: the ServiceAccount no longer allows the hub user: permission denied",
			sentinel: errdefs.ErrPermissionDenied,
		},
		{
			name:     "audience withdrawn",
			now:      policySA("deployer", argocd, ""),
			wantErr:  "spoke ServiceAccount apps/deployer changed its policy while the token was minted: the ServiceAccount no longer allows an audience of the token: permission denied",
			sentinel: errdefs.ErrPermissionDenied,
		},
		{
			name:     "ServiceAccount deleted",
			wantErr:  "spoke ServiceAccount apps/deployer was deleted while the token was minted: not found",
			sentinel: errdefs.ErrNotFound,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			old := policySA("deployer", argocd, "vault")
			indexer, sal := cachedServiceAccounts(t, old)
			grants := hookGrants{fakeGrants: newFakeGrants(), onCreate: func() {
				if tt.now == nil {
					require.NoError(t, indexer.Delete(old))
				} else {
					require.NoError(t, indexer.Update(tt.now))
				}
			}}
			tokens := &fakeTokens{}
			m, err := New(Config{Tokens: tokens, Grants: grants, GrantCache: grants.cache, ServiceAccounts: sal})
			require.NoError(t, err)
			resp, err := m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), Audiences: []string{"vault"}})
			requireRefused(t, tokens, resp, err, tt.wantErr, tt.sentinel)
			assert.Equal(t, []string{"apps/credbroker-grant-1"}, grants.Deleted())
			assert.Empty(t, grants.Keys())
		})
	}
}
