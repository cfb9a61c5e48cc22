package spoke

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	corev1listers "k8s.io/client-go/listers/core/v1"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// The pooled grants of a Minter (pool.go, claim.go), attacked as a spoke
// namespace owner who may create, change and delete the Secrets of the
// ServiceAccount's namespace, and without the admission policy that would
// stop them (deploy/spoke/admission.yaml).

var poolCluster = fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: "fleet", Name: "prod"}, UID: "prod-uid"}

// gatedGrants is a fakeGrants whose Patches of grant claims wait, between
// hold and let, until let; it records the UIDs of the grants claimed.
type gatedGrants struct {
	*fakeGrants
	gateMu  sync.Mutex
	release chan struct{}
	claimed []types.UID
}

func (g *gatedGrants) hold() {
	g.gateMu.Lock()
	defer g.gateMu.Unlock()
	g.release = make(chan struct{})
}

func (g *gatedGrants) let() {
	g.gateMu.Lock()
	defer g.gateMu.Unlock()
	close(g.release)
	g.release = nil
}

func (g *gatedGrants) Patch(ctx context.Context, namespace, name string, patch []byte) error {
	g.gateMu.Lock()
	release := g.release
	g.gateMu.Unlock()
	claim := strings.Contains(string(patch), GrantHubUserAnnotation)
	if release != nil && claim {
		<-release
	}
	err := g.fakeGrants.Patch(ctx, namespace, name, patch)
	if s := g.Get(namespace + "/" + name); err == nil && claim && s != nil {
		g.gateMu.Lock()
		g.claimed = append(g.claimed, s.UID)
		g.gateMu.Unlock()
	}
	return err
}

func (g *gatedGrants) Claimed() []types.UID {
	g.gateMu.Lock()
	defer g.gateMu.Unlock()
	return append([]types.UID(nil), g.claimed...)
}

// poolMinter returns a Minter with a pool of two over grants (which it
// writes through store, grants when nil), whose events reach it, running
// until the test ends, for the ServiceAccounts of sas.
func poolMinter(t *testing.T, tokens TokenCreator, grants *fakeGrants, store GrantStore, sas corev1listers.ServiceAccountLister) *Minter {
	t.Helper()
	if store == nil {
		store = grants
	}
	clk := testingclock.NewFakeClock(issuedAt)
	m, err := New(Config{Tokens: tokens, ServiceAccounts: sas, Grants: store, GrantCache: grants.cache, PoolSize: 2, Clock: clk})
	require.NoError(t, err)
	grants.mu.Lock()
	grants.events = m.GrantEvents()
	grants.mu.Unlock()
	startRun(t, m, grants, clk)
	return m
}

// pooledGrants returns the keys of the unclaimed grants grants holds.
func (f *fakeGrants) pooledGrants() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for k, s := range f.secrets {
		if unclaimed(s) {
			out = append(out, k)
		}
	}
	return out
}

// failWrites fails every patch and delete from now on, as a spoke whose
// etcd is down would.
func (f *fakeGrants) failWrites() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.patchErr = apierrors.NewInternalError(fmt.Errorf("etcd is down"))
	f.deleteErr = f.patchErr
}

// edit changes the grant key as someone other than the agent would.
func (f *fakeGrants) edit(key string, change func(*corev1.Secret)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	old := f.secrets[key]
	now := old.DeepCopy()
	change(now)
	f.secrets[key] = now
	f.inform(old, now)
}

// replace deletes the grant key and creates in its place, under its name,
// a Secret of another UID that looks like a pooled grant.
func (f *fakeGrants) replace(key string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	old := f.secrets[key]
	now := old.DeepCopy()
	now.UID = "replacement-" + old.UID
	f.inform(old, nil)
	f.secrets[key] = now
	f.inform(nil, now)
}

// fillPool mints once for req, which fills the pool of its ServiceAccount,
// and waits until the pool holds two grants.
func fillPool(t *testing.T, m *Minter, grants *fakeGrants, req *credbrokerv1alpha1.MintRequest) {
	t.Helper()
	_, err := m.Mint(t.Context(), poolCluster, req)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return len(grants.pooledGrants()) == 2 }, 5*time.Second, time.Millisecond, "the pool was not filled")
}

func deployerRequest() *credbrokerv1alpha1.MintRequest {
	return &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref("apps", "deployer")}
}

// boundTo returns the grant the token of TokenRequest call i is bound to.
func boundTo(t *testing.T, tokens *fakeTokens, i int) (string, types.UID) {
	t.Helper()
	calls := tokens.Calls()
	require.Greater(t, len(calls), i)
	b := calls[i].req.Spec.BoundObjectRef
	return calls[i].namespace + "/" + b.Name, b.UID
}

func TestPooledMintClaimsItsGrantAfterTheAnswer(t *testing.T) {
	tokens, grants := &fakeTokens{}, newFakeGrants()
	m := poolMinter(t, tokens, grants, nil, lister(t, serviceAccount("apps", "deployer", argocd)))
	fillPool(t, m, grants, deployerRequest())
	pooled := grants.pooledGrants()

	resp, err := m.Mint(t.Context(), poolCluster, &credbrokerv1alpha1.MintRequest{
		Subject: subject(argocd), ServiceAccount: ref("apps", "deployer"), ExpirationSeconds: 1200})
	require.NoError(t, err)
	key, uid := boundTo(t, tokens, 1)
	assert.Contains(t, pooled, key, "the token is bound to a pooled grant")
	require.Eventually(t, func() bool { return !unclaimed(grants.Get(key)) }, 5*time.Second, time.Millisecond, "the grant was never claimed")
	g := grants.Get(key)
	assert.Equal(t, uid, g.UID)
	assert.Empty(t, foreignChange(g, m.maxLifetime()), "a claimed grant is what the agent writes")
	assert.Equal(t, map[string]string{
		GrantServiceAccountAnnotation:    "deployer",
		GrantHubUserAnnotation:           argocd,
		GrantHubUIDAnnotation:            "hub-uid",
		GrantHubGroupsAnnotation:         "system:serviceaccounts",
		GrantClusterProfileAnnotation:    "fleet/prod",
		GrantClusterProfileUIDAnnotation: "prod-uid",
		GrantAudiencesAnnotation:         "",
		GrantExpirationAnnotation:        resp.GetExpirationTime().AsTime().Format(time.RFC3339),
		GrantCredentialIDAnnotation:      "JTI=jti-apps-deployer",
		GrantTokenSHA256Annotation:       fmt.Sprintf("%x", sha256Of(resp.GetToken())),
	}, g.Annotations)
	assert.Equal(t, "jti-apps-deployer", g.Labels[GrantJTILabel])
	require.Eventually(t, func() bool { return len(grants.pooledGrants()) == 2 }, 5*time.Second, time.Millisecond, "the pool was not refilled")
}

func TestPoolSurvivesSweepsAndIsDeletedOnShutdown(t *testing.T) {
	tokens, grants := &fakeTokens{}, newFakeGrants()
	clk := testingclock.NewFakeClock(issuedAt)
	m, err := New(Config{Tokens: tokens, ServiceAccounts: lister(t, serviceAccount("apps", "deployer", argocd)),
		Grants: grants, GrantCache: grants.cache, PoolSize: 2, Clock: clk})
	require.NoError(t, err)
	grants.events = m.GrantEvents()
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	require.Eventually(t, func() bool { return grants.Lists() >= 1 && clk.HasWaiters() }, 5*time.Second, time.Millisecond)
	fillPool(t, m, grants, deployerRequest())
	pooled := grants.pooledGrants()

	clk.Step(DefaultCollectInterval)
	require.Eventually(t, func() bool { return grants.Lists() >= 2 }, 5*time.Second, time.Millisecond, "Run never swept again")
	assert.ElementsMatch(t, pooled, grants.pooledGrants(), "a sweep deletes no pooled grant")

	cancel()
	require.NoError(t, <-done)
	assert.Empty(t, grants.pooledGrants(), "Run deletes its pooled grants when it returns")
}

// A pooled grant changed or replaced by someone else is never bound to:
// the mint creates a grant of its own instead.
func TestPooledGrantChangedBySomeoneElseIsNotUsed(t *testing.T) {
	tests := []struct {
		name   string
		attack func(f *fakeGrants, key string)
	}{
		{"claimed for another hub user", func(f *fakeGrants, key string) {
			f.edit(key, func(s *corev1.Secret) {
				for _, k := range grantAnnotations {
					if _, ok := s.Annotations[k]; !ok {
						s.Annotations[k] = ""
					}
				}
				s.Annotations[GrantHubUserAnnotation] = "system:serviceaccount:victim:victim"
			})
		}},
		{"finalizer added", func(f *fakeGrants, key string) {
			f.edit(key, func(s *corev1.Secret) { s.Finalizers = []string{"example.com/hold"} })
		}},
		{"data added", func(f *fakeGrants, key string) {
			f.edit(key, func(s *corev1.Secret) { s.Data = map[string][]byte{"token": nil} })
		}},
		{"expiry stretched", func(f *fakeGrants, key string) {
			f.edit(key, func(s *corev1.Secret) {
				s.Annotations[GrantExpirationAnnotation] = issuedAt.Add(365 * 24 * time.Hour).Format(time.RFC3339)
			})
		}},
		{"replaced under its name", func(f *fakeGrants, key string) { f.replace(key) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tokens, grants := &fakeTokens{}, newFakeGrants()
			m := poolMinter(t, tokens, grants, nil, lister(t, serviceAccount("apps", "deployer", argocd)))
			fillPool(t, m, grants, deployerRequest())
			attacked := map[string]types.UID{}
			for _, key := range grants.pooledGrants() {
				attacked[key] = grants.Get(key).UID
				tt.attack(grants, key)
			}

			_, err := m.Mint(t.Context(), poolCluster, deployerRequest())
			require.NoError(t, err)
			key, uid := boundTo(t, tokens, 1)
			assert.NotEqual(t, attacked[key], uid, "the token is bound to a grant someone else changed")
			assert.True(t, strings.HasPrefix(string(uid), "grant-uid-"), "the token is bound to %s of UID %s, which the agent did not create", key, uid)
		})
	}
}

// Deleting a pooled grant under the agent, between the mint's pick and its
// TokenRequest, fails nothing: the mint creates a grant of its own.
func TestPooledGrantDeletedUnderTheMint(t *testing.T) {
	grants := newFakeGrants()
	tokens := &goneOnceTokens{grants: grants}
	m := poolMinter(t, tokens, grants, nil, lister(t, serviceAccount("apps", "deployer", argocd)))
	fillPool(t, m, grants, deployerRequest())
	tokens.arm()

	resp, err := m.Mint(t.Context(), poolCluster, deployerRequest())
	require.NoError(t, err)
	assert.NotEmpty(t, resp.GetToken())
	calls := tokens.Calls()
	require.Len(t, calls, 3)
	assert.NotEqual(t, calls[1].req.Spec.BoundObjectRef.Name, calls[2].req.Spec.BoundObjectRef.Name)
	assert.NotNil(t, grants.Get("apps/"+calls[2].req.Spec.BoundObjectRef.Name), "the token is bound to a live grant")
}

// goneOnceTokens is a fakeTokens that, once armed, deletes the grant of
// its next TokenRequest first, as a namespace owner would.
type goneOnceTokens struct {
	fakeTokens
	grants *fakeGrants
	mu     sync.Mutex
	armed  bool
}

func (g *goneOnceTokens) arm() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.armed = true
}

func (g *goneOnceTokens) CreateToken(ctx context.Context, namespace, name string, req *authenticationv1.TokenRequest) (*authenticationv1.TokenRequest, error) {
	g.mu.Lock()
	armed := g.armed
	g.armed = false
	g.mu.Unlock()
	if armed {
		b := req.Spec.BoundObjectRef
		if err := g.grants.Delete(ctx, namespace, b.Name, b.UID); err != nil {
			return nil, err
		}
		g.fakeTokens.mu.Lock()
		g.fakeTokens.calls = append(g.fakeTokens.calls, createCall{namespace: namespace, name: name, req: req.DeepCopy()})
		g.fakeTokens.mu.Unlock()
		return nil, apierrors.NewNotFound(secretsResource, b.Name)
	}
	return g.fakeTokens.CreateToken(ctx, namespace, name, req)
}

// A claim that fails revokes the token: the grant is deleted.
func TestFailedClaimDeletesTheGrant(t *testing.T) {
	tokens, grants := &fakeTokens{}, newFakeGrants()
	m := poolMinter(t, tokens, grants, nil, lister(t, serviceAccount("apps", "deployer", argocd)))
	fillPool(t, m, grants, deployerRequest())
	grants.mu.Lock()
	grants.patchErr = apierrors.NewInternalError(fmt.Errorf("etcd is down"))
	grants.mu.Unlock()

	_, err := m.Mint(t.Context(), poolCluster, deployerRequest())
	require.NoError(t, err)
	key, _ := boundTo(t, tokens, 1)
	require.Eventually(t, func() bool { return grants.Get(key) == nil }, 5*time.Second, time.Millisecond,
		"a grant whose claim failed must be deleted, which revokes its token")
}

// deleteOthersOfTheID deletes the grant that mintHeld's first mint bound
// its token to: the fake gives every token of a ServiceAccount one
// credential id, and a revoke must find only the grant key.
func deleteOthersOfTheID(t *testing.T, grants *fakeGrants, key string) {
	t.Helper()
	grants.mu.Lock()
	var first []*corev1.Secret
	for k, g := range grants.secrets {
		if k != key && g.Annotations[GrantCredentialIDAnnotation] == "JTI=jti-apps-deployer" {
			first = append(first, g)
		}
	}
	grants.mu.Unlock()
	require.Len(t, first, 1)
	require.NoError(t, grants.Delete(t.Context(), first[0].Namespace, first[0].Name, first[0].UID))
}

// mintHeld fills the pool of a Minter over grants for the ServiceAccounts
// of sas, then mints with claims held until gated.let, and returns the
// Minter and the bound grant's key and UID.
func mintHeld(t *testing.T, tokens *fakeTokens, grants *fakeGrants, sas corev1listers.ServiceAccountLister) (m *Minter, gated *gatedGrants, key string, uid types.UID) {
	t.Helper()
	gated = &gatedGrants{fakeGrants: grants}
	m = poolMinter(t, tokens, grants, gated, sas)
	fillPool(t, m, grants, deployerRequest())
	gated.hold()
	_, err := m.Mint(t.Context(), poolCluster, deployerRequest())
	require.NoError(t, err)
	key, uid = boundTo(t, tokens, 1)
	return m, gated, key, uid
}

// A claim lands only on the grant the token is bound to: a Secret that
// replaced it under its name between the answer and the claim does not get
// the token's attribution.
func TestClaimDoesNotLandOnAReplacement(t *testing.T) {
	grants := newFakeGrants()
	_, gated, key, uid := mintHeld(t, &fakeTokens{}, grants, lister(t, serviceAccount("apps", "deployer", argocd)))
	grants.replace(key)
	gated.let()
	require.Eventually(t, func() bool { return grants.Deletes() > 0 }, 5*time.Second, time.Millisecond, "the failed claim never deleted")
	assert.NotContains(t, gated.Claimed(), "replacement-"+uid, "the replacement got the token's attribution")
}

// A grant its token's holder deletes before the claim lands is reported
// removed under the token's credential id: the broker that minted the
// token recorded it at the answer, and must stop handing out a token the
// spoke now refuses.
func TestGrantGoneBeforeTheClaimLandsIsReportedRemoved(t *testing.T) {
	for _, order := range []string{"deleted before the claim fails", "deleted unseen by the informer", "deleted after the claim fails",
		"changed by someone else, then deleted"} {
		t.Run(order, func(t *testing.T) {
			grants := newFakeGrants()
			m, gated, key, uid := mintHeld(t, &fakeTokens{}, grants, lister(t, serviceAccount("apps", "deployer", argocd)))
			var r recorder
			defer m.Subscribe(r.fn)()
			ns, name, _ := strings.Cut(key, "/")
			switch order {
			case "changed by someone else, then deleted":
				// The agent deletes a grant someone else changed; the claim
				// then finds it gone.
				grants.edit(key, func(s *corev1.Secret) { s.Labels["credbroker.io/x"] = "y" })
				require.Eventually(t, func() bool { return grants.Get(key) == nil }, 5*time.Second, time.Millisecond, "the changed grant was not deleted")
				gated.let()
				m.pool.taken.Wait()
			case "deleted before the claim fails", "deleted unseen by the informer":
				grants.mu.Lock()
				grants.lag = order == "deleted unseen by the informer"
				grants.mu.Unlock()
				require.NoError(t, grants.Delete(t.Context(), ns, name, uid))
				gated.let()
				m.pool.taken.Wait() // the claim, and its failure, are done
			default:
				// The claim fails, the agent's delete too: the grant is
				// deleted later, by someone else.
				grants.failWrites()
				gated.let()
				m.pool.taken.Wait()
				assert.Empty(t, r.summary(), "a grant that is still there was reported removed")
				grants.setDeleteErr(nil)
				require.NoError(t, grants.Delete(t.Context(), ns, name, uid))
			}
			assert.Equal(t, []string{"-JTI=jti-apps-deployer"}, r.summary())
			assert.Equal(t, []string{"JTI=jti-apps-deployer"}, m.Removed(), "the removal is not told to the streams to come")
		})
	}
}

// A claim that fails, its grant's delete failing too, leaves a token that
// lives on its grant: a revoke of its credential id must not answer it
// gone, and deletes the grant once the spoke lets it.
func TestRevokeAfterAFailedClaimDeletesTheGrant(t *testing.T) {
	grants := newFakeGrants()
	m, gated, key, _ := mintHeld(t, &fakeTokens{}, grants, lister(t, serviceAccount("apps", "deployer", argocd)))
	deleteOthersOfTheID(t, grants, key)
	var r recorder
	defer m.Subscribe(r.fn)()
	grants.failWrites()
	gated.let()
	m.pool.taken.Wait()
	revoke := &credbrokerv1alpha1.RevokeRequest{CredentialIds: []string{"JTI=jti-apps-deployer"}}

	_, err := m.Revoke(t.Context(), poolCluster, revoke)
	require.ErrorIs(t, err, errdefs.ErrUnavailable, "a revoke whose delete failed was answered")
	require.NotNil(t, grants.Get(key))

	grants.setDeleteErr(nil)
	resp, err := m.Revoke(t.Context(), poolCluster, revoke)
	require.NoError(t, err)
	assert.Equal(t, []string{"JTI=jti-apps-deployer"}, resp.GetCredentialIds())
	assert.Nil(t, grants.Get(key), "the revoke left the grant, and so the token, alive")
	assert.Equal(t, []string{"-JTI=jti-apps-deployer"}, r.summary())
}

// A pooled grant someone else changed before its claim landed is still
// the minting broker's to revoke: the agent takes what the grant records
// from its claim, not from the unclaimed grant it had seen.
func TestRevokeOfAGrantChangedBeforeItsClaim(t *testing.T) {
	grants := newFakeGrants()
	m, gated, key, _ := mintHeld(t, &fakeTokens{}, grants, lister(t, serviceAccount("apps", "deployer", argocd)))
	t.Cleanup(gated.let)
	deleteOthersOfTheID(t, grants, key)
	grants.setDeleteErr(apierrors.NewInternalError(fmt.Errorf("etcd is down")))
	grants.edit(key, func(s *corev1.Secret) { s.Labels["credbroker.io/x"] = "y" })
	require.Eventually(t, func() bool { return grants.Deletes() > 0 }, 5*time.Second, time.Millisecond, "the agent never tried to delete the changed grant")

	before := grants.Deletes()
	_, err := m.Revoke(t.Context(), poolCluster, &credbrokerv1alpha1.RevokeRequest{CredentialIds: []string{"JTI=jti-apps-deployer"}})
	require.ErrorIs(t, err, errdefs.ErrUnavailable, "the revoke did not try to delete the grant")
	assert.Greater(t, grants.Deletes(), before)
}

// A revoke of a credential id whose claim has not landed yet deletes its
// grant: a token is revocable from the moment it is answered.
func TestRevokeBeforeTheClaimLands(t *testing.T) {
	grants := newFakeGrants()
	m, gated, key, _ := mintHeld(t, &fakeTokens{}, grants, lister(t, serviceAccount("apps", "deployer", argocd)))
	t.Cleanup(gated.let)
	resp, err := m.Revoke(t.Context(), poolCluster, &credbrokerv1alpha1.RevokeRequest{CredentialIds: []string{"JTI=jti-apps-deployer"}})
	require.NoError(t, err)
	assert.Equal(t, []string{"JTI=jti-apps-deployer"}, resp.GetCredentialIds())
	assert.Nil(t, grants.Get(key), "the revoke left the grant, and so the token, alive")
}

// A policy change that reaches the agent between the answer and the claim
// revokes the token once the claim lands.
func TestPolicyChangeBeforeTheClaimLandsRevokes(t *testing.T) {
	grants := newFakeGrants()
	sa := serviceAccount("apps", "deployer", argocd)
	saCache, sas := cachedServiceAccounts(t, sa)
	m, gated, key, _ := mintHeld(t, &fakeTokens{}, grants, sas)
	// The pool refilled: two pooled grants and the one claimed.
	require.Eventually(t, func() bool { return len(grants.pooledGrants()) == 3 }, 5*time.Second, time.Millisecond)
	reconciled := len(grants.SALists())
	withdrawn := serviceAccount("apps", "deployer", flux)
	require.NoError(t, saCache.Update(withdrawn))
	m.PolicyChanged(sa, withdrawn)
	require.Eventually(t, func() bool { return len(grants.SALists()) > reconciled }, 5*time.Second, time.Millisecond, "no Reconcile ran")
	require.NotNil(t, grants.Get(key), "the unclaimed grant is left to its claim")
	gated.let()
	require.Eventually(t, func() bool { return grants.Get(key) == nil }, 5*time.Second, time.Millisecond,
		"the claimed grant of a withdrawn subject was not revoked")
}

// A complete claim that someone else writes onto a pooled grant is not
// taken for the agent's: the grant is deleted, and no broker hears of it.
func TestClaimBySomeoneElseIsRevoked(t *testing.T) {
	tokens, grants := &fakeTokens{}, newFakeGrants()
	m := poolMinter(t, tokens, grants, nil, lister(t, serviceAccount("apps", "deployer", argocd)))
	fillPool(t, m, grants, deployerRequest())
	var (
		mu    sync.Mutex
		added []string
	)
	unsubscribe := m.Subscribe(func(u *credbrokerv1alpha1.GrantUpdate) {
		mu.Lock()
		defer mu.Unlock()
		for _, g := range u.GetAdded() {
			added = append(added, g.GetCredentialId())
		}
	})
	defer unsubscribe()
	key := grants.pooledGrants()[0]
	grants.edit(key, func(s *corev1.Secret) {
		tok := mintedToken{token: "forged", id: "JTI=forged", exp: issuedAt.Add(time.Hour)}
		info := grantInfo{serviceAccount: serviceAccount("apps", "deployer", ""), hubUser: "system:serviceaccount:victim:victim",
			clusterProfile: "fleet/prod", expiration: tok.exp}
		claimed := claimedGrant(s, info, tok)
		s.Labels, s.Annotations = claimed.Labels, claimed.Annotations
	})
	require.Eventually(t, func() bool { return grants.Get(key) == nil }, 5*time.Second, time.Millisecond, "the foreign claim was kept")
	mu.Lock()
	defer mu.Unlock()
	assert.NotContains(t, added, "JTI=forged", "a broker heard of the foreign claim")
}

// A pooled grant whose expiry someone stretched while no agent ran is
// deleted as changed: it would keep a token whose claim never landed from
// being collected.
func TestStretchedPooledGrantIsDeletedAtStart(t *testing.T) {
	s := newGrantOf(types.NamespacedName{Namespace: "apps", Name: "deployer"}, issuedAt.Add(365*24*time.Hour))
	s.Name, s.UID, s.CreationTimestamp = "credbroker-grant-stretched", "stretched", metav1.NewTime(issuedAt)
	tokens, grants := &fakeTokens{}, newFakeGrants(s)
	poolMinter(t, tokens, grants, nil, lister(t, serviceAccount("apps", "deployer", argocd)))
	require.Eventually(t, func() bool { return grants.Get("apps/credbroker-grant-stretched") == nil }, 5*time.Second, time.Millisecond,
		"a pooled grant that outlives its pooled lifetime was kept")
}

// Grants that someone else planted to look pooled are never bound to:
// the pool holds only grants the agent created.
func TestPlantedPooledGrantIsNotUsed(t *testing.T) {
	var planted []*corev1.Secret
	for i := range 2 {
		s := newGrantOf(types.NamespacedName{Namespace: "apps", Name: "deployer"}, issuedAt.Add(poolGrantTTL))
		s.Name, s.UID = fmt.Sprintf("credbroker-grant-planted-%d", i), types.UID(fmt.Sprintf("planted-%d", i))
		s.CreationTimestamp = metav1.NewTime(issuedAt)
		planted = append(planted, s)
	}
	tokens, grants := &fakeTokens{}, newFakeGrants(planted...)
	m := poolMinter(t, tokens, grants, nil, lister(t, serviceAccount("apps", "deployer", argocd)))
	for i := range 2 {
		_, err := m.Mint(t.Context(), poolCluster, deployerRequest())
		require.NoError(t, err)
		key, _ := boundTo(t, tokens, i)
		assert.NotContains(t, key, "planted", "mint %d bound its token to a planted grant", i)
	}
}

// Trust round 3, case 3. Attack: the agent's own spoke identity, stolen,
// writes a grant exactly as the agent would, claimed and complete, but
// with an expiry ten years ahead. The brokers dropped only that grant from
// the agent's reports once their half was fixed; the agent reported it at
// every hello and kept it on the spoke.
// Defence: an expiry further past the grant's creation than any token the
// agent mints (after a pooled grant's wait, and a clock skew) is a change
// by someone else: the grant is deleted at first sight and never reported.
// One that expires at the bound's edge is kept.
func TestGrantExpiringPastAnyTokenIsDeleted(t *testing.T) {
	sa := serviceAccount("apps", "deployer", argocd)
	grantExpiring := func(name string, exp time.Time) *corev1.Secret {
		info := grantInfo{serviceAccount: sa, hubUser: argocd, hubUID: "hub-uid", hubGroups: []string{"system:serviceaccounts"},
			clusterProfile: "fleet/prod", clusterUID: "prod-uid"}
		s := claimedGrant(newGrantOf(types.NamespacedName{Namespace: "apps", Name: "deployer"}, exp), info,
			mintedToken{token: "token-of-" + name, exp: exp, id: "JTI=" + name})
		s.Name, s.UID, s.CreationTimestamp = "credbroker-grant-"+name, types.UID(name), metav1.NewTime(issuedAt)
		return s
	}
	edge := issuedAt.Add(poolGrantTTL + time.Hour + poolClockSkew) // the default maximum lifetime is an hour
	tokens, grants := &fakeTokens{}, newFakeGrants(
		grantExpiring("decade", issuedAt.AddDate(10, 0, 0)),
		grantExpiring("edge", edge),
	)
	m := poolMinter(t, tokens, grants, nil, lister(t, sa))
	require.Eventually(t, func() bool { return grants.Get("apps/credbroker-grant-decade") == nil }, 5*time.Second, time.Millisecond,
		"a grant that expires past any token the agent mints was kept")
	assert.NotNil(t, grants.Get("apps/credbroker-grant-edge"), "a grant at the edge of the bound was deleted")
	var reported []string
	for _, g := range m.Snapshot() {
		reported = append(reported, g.GetCredentialId())
	}
	assert.Equal(t, []string{"JTI=edge"}, reported)
}
