package spoke

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// admitted is the ClusterProfile ("namespace/name") a request's stream was
// admitted for.
func admitted(profile string) fleet.ClusterRef {
	namespace, name, _ := strings.Cut(profile, "/")
	return fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: namespace, Name: name}}
}

// profileGrant is grantOf, recorded for ClusterProfile profile.
func profileGrant(namespace, name, sa, user, profile string) *corev1.Secret {
	g := grantOf(namespace, name, sa, user, "")
	g.Annotations[GrantClusterProfileAnnotation] = profile
	return g
}

// grantsMinter is a Minter over grants.
func grantsMinter(t *testing.T, grants *fakeGrants, log ...func(*Config)) *Minter {
	t.Helper()
	cfg := withGrants(Config{Tokens: &fakeTokens{}, ServiceAccounts: lister(t)}, grants)
	for _, f := range log {
		f(&cfg)
	}
	m, err := New(cfg)
	require.NoError(t, err)
	return m
}

// The attack: a broker that admitted the agent for ClusterProfile fleet/b
// (a hostile or mistaken broker, or one that maps the agent's SPIFFE ID to
// another profile) asks it to revoke the tokens minted through fleet/a.
// Only the grants recorded for fleet/b may go.
func TestRevokeOnlyGrantsOfTheAdmittedClusterProfile(t *testing.T) {
	aGrant := profileGrant("apps", "of-a", "deployer", argocd, "fleet/a")
	bGrant := profileGrant("apps", "of-b", "deployer", argocd, "fleet/b")
	// Recorded on the API server, not yet in the agent's cache.
	aLagging := profileGrant("apps", "of-a-new", "deployer", argocd, "fleet/a")
	noProfile := profileGrant("apps", "of-none", "deployer", argocd, "")
	ids := []string{"JTI=jti-of-a", "JTI=jti-of-b", "JTI=jti-of-a-new", "JTI=jti-of-none"}

	tests := []struct {
		name     string
		admitted fleet.ClusterRef
		gone     []string
		deleted  []string
		sentinel error
	}{
		{
			name:     "admitted for fleet/b: only fleet/b's grant goes",
			admitted: admitted("fleet/b"),
			gone:     []string{"JTI=jti-of-b"},
			deleted:  []string{"apps/of-b"},
		},
		{
			name:     "admitted for fleet/a: its grants go, the lagging one too",
			admitted: admitted("fleet/a"),
			gone:     []string{"JTI=jti-of-a", "JTI=jti-of-a-new"},
			deleted:  []string{"apps/of-a", "apps/of-a-new"},
		},
		{
			name:     "no admitted ClusterProfile: nothing goes, not even a grant that records none",
			sentinel: errdefs.ErrPermissionDenied,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			grants := newFakeGrants(aGrant, bGrant, noProfile)
			grants.secrets["apps/of-a-new"] = aLagging.DeepCopy()
			log, lines := capture()
			m := grantsMinter(t, grants, func(c *Config) { c.Log = log })

			resp, err := m.Revoke(t.Context(), tt.admitted, &credbrokerv1alpha1.RevokeRequest{CredentialIds: ids, Reason: "test"})
			if tt.sentinel != nil {
				require.ErrorIs(t, err, tt.sentinel)
				assert.Nil(t, resp)
			} else {
				require.NoError(t, err)
				assert.Equal(t, tt.gone, resp.GetCredentialIds())
			}
			assert.ElementsMatch(t, tt.deleted, grants.Deleted())
			if tt.sentinel == nil {
				assert.Contains(t, lines.String(), `"msg"="refused to revoke a grant of another ClusterProfile"`)
			}
		})
	}
}

func TestRevoke(t *testing.T) {
	boom := apierrors.NewInternalError(errors.New("boom"))
	notAGrant := profileGrant("apps", "db-password", "deployer", argocd, "fleet/a")
	notAGrant.Type = corev1.SecretTypeOpaque
	tests := []struct {
		name      string
		ids       []string
		lag       bool // the cache has none of the grants
		deleteErr error
		listErr   error
		gone      []string
		deleted   []string
		lookups   []string
		wantErr   string
	}{
		{
			name:    "grants in the cache",
			ids:     []string{"JTI=jti-one", "JTI=jti-two"},
			gone:    []string{"JTI=jti-one", "JTI=jti-two"},
			deleted: []string{"apps/one", "apps/two"},
		},
		{
			name:    "repeated and empty ids are revoked once",
			ids:     []string{"", "JTI=jti-one", "JTI=jti-one"},
			gone:    []string{"JTI=jti-one"},
			deleted: []string{"apps/one"},
		},
		{
			name:    "a grant the cache has not seen yet is looked up and revoked",
			ids:     []string{"JTI=jti-one"},
			lag:     true,
			gone:    []string{"JTI=jti-one"},
			deleted: []string{"apps/one"},
			lookups: []string{"JTI=jti-one"},
		},
		{
			name:    "a grant found nowhere is gone already",
			ids:     []string{"JTI=unknown"},
			gone:    []string{"JTI=unknown"},
			lookups: []string{"JTI=unknown"},
		},
		{
			name:    "a Secret that is not a grant is never deleted",
			ids:     []string{"JTI=jti-db-password"},
			gone:    []string{"JTI=jti-db-password"},
			lookups: []string{"JTI=jti-db-password"},
		},
		{
			name:      "every delete fails: an error, and nothing gone",
			ids:       []string{"JTI=jti-one", "JTI=jti-two"},
			deleteErr: boom,
			wantErr: "revoke grants: revoke grant apps/one of credential JTI=jti-one: Internal error occurred: boom: unavailable\n" +
				"revoke grant apps/two of credential JTI=jti-two: Internal error occurred: boom: unavailable",
		},
		{
			name:      "some fail: the others are answered, with no error",
			ids:       []string{"JTI=jti-one", "JTI=unknown"},
			deleteErr: boom,
			gone:      []string{"JTI=unknown"},
			lookups:   []string{"JTI=unknown"},
		},
		{
			name:    "the lookup fails",
			ids:     []string{"JTI=unknown"},
			listErr: boom,
			lookups: []string{"JTI=unknown"},
			wantErr: "revoke grants: look up the grant of credential JTI=unknown on the spoke API server: Internal error occurred: boom: unavailable",
		},
		{
			name:      "a grant already deleted is gone",
			ids:       []string{"JTI=jti-one"},
			deleteErr: apierrors.NewNotFound(secretsResource, "one"),
			gone:      []string{"JTI=jti-one"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			existing := []*corev1.Secret{
				profileGrant("apps", "one", "deployer", argocd, "fleet/a"),
				profileGrant("apps", "two", "deployer", flux, "fleet/a"),
				notAGrant,
			}
			grants := newFakeGrants()
			for _, s := range existing {
				grants.secrets[s.Namespace+"/"+s.Name] = s.DeepCopy()
				if !tt.lag {
					require.NoError(t, grants.cache.Add(s.DeepCopy()))
				}
			}
			grants.deleteErr, grants.listErr = tt.deleteErr, tt.listErr
			m := grantsMinter(t, grants)

			resp, err := m.Revoke(t.Context(), admitted("fleet/a"), &credbrokerv1alpha1.RevokeRequest{CredentialIds: tt.ids, Reason: "test"})
			if tt.wantErr != "" {
				require.EqualError(t, err, tt.wantErr)
				assert.ErrorIs(t, err, errdefs.ErrUnavailable)
				assert.Nil(t, resp)
			} else {
				require.NoError(t, err)
				assert.Equal(t, tt.gone, resp.GetCredentialIds())
			}
			assert.ElementsMatch(t, tt.deleted, grants.Deleted())
			assert.Equal(t, tt.lookups, grants.Lookups())
			assert.Contains(t, grants.Keys(), "apps/db-password")
		})
	}
}

// Revoke logs each revocation with its credential id, subject,
// ServiceAccount and reason, and stops the grant's expiry timer.
func TestRevokeLogsAndStopsTheTimer(t *testing.T) {
	clk := testingclock.NewFakeClock(issuedAt)
	grants := newFakeGrants()
	log, lines := capture()
	m, err := New(withGrants(Config{Tokens: &fakeTokens{}, Clock: clk, CollectInterval: time.Hour, Log: log,
		ServiceAccounts: lister(t, serviceAccount("apps", "deployer", argocd))}, grants))
	require.NoError(t, err)
	startRun(t, m, grants, clk)
	resp, err := m.Mint(t.Context(), admitted("fleet/a"), &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ExpirationSeconds: 900})
	require.NoError(t, err)
	m.mu.Lock()
	require.Len(t, m.timers, 1)
	m.mu.Unlock()

	got, err := m.Revoke(t.Context(), admitted("fleet/a"), &credbrokerv1alpha1.RevokeRequest{
		CredentialIds: []string{"JTI=jti-apps-deployer"}, Reason: "hub RBAC no longer allows the consumer",
	})
	require.NoError(t, err)
	assert.Equal(t, []string{"JTI=jti-apps-deployer"}, got.GetCredentialIds())
	assert.Equal(t, []string{"apps/credbroker-grant-1"}, grants.Deleted())
	m.mu.Lock()
	assert.Empty(t, m.timers, "the revoked grant's timer still runs")
	m.mu.Unlock()
	assert.Contains(t, lines.String(), `"msg"="revoked grant" "grant"="apps/credbroker-grant-1" "credentialID"="JTI=jti-apps-deployer" `+
		`"subject"="`+argocd+`" "serviceAccount"="apps/deployer" "audiences"=[] "reason"="hub RBAC no longer allows the consumer"`)
	assert.NotContains(t, lines.String(), resp.GetToken())
}

func TestSnapshot(t *testing.T) {
	full := profileGrant("apps", "full", "deployer", argocd, "fleet/a")
	full.Annotations[GrantHubUIDAnnotation] = "hub-uid"
	full.Annotations[GrantHubGroupsAnnotation] = "system:serviceaccounts,team%2Ca"
	full.Annotations[GrantClusterProfileUIDAnnotation] = "uid-a"
	full.Annotations[GrantAudiencesAnnotation] = "vault,sts"
	other := profileGrant("tools", "other", "reader", flux, "fleet/b")
	unminted := profileGrant("apps", "unminted", "deployer", argocd, "fleet/a")
	delete(unminted.Annotations, GrantCredentialIDAnnotation)
	notAGrant := profileGrant("apps", "db-password", "deployer", argocd, "fleet/a")
	notAGrant.Type = corev1.SecretTypeOpaque
	// An expiration the agent would not write: someone else changed it, and
	// it is being deleted.
	garbled := profileGrant("apps", "garbled", "deployer", argocd, "fleet/a")
	garbled.Annotations[GrantExpirationAnnotation] = "tomorrow"
	garbled.CreationTimestamp = metav1.NewTime(issuedAt)
	m := grantsMinter(t, newFakeGrants(other, full, unminted, notAGrant, garbled))

	want := []*credbrokerv1alpha1.Grant{
		{
			CredentialId:   "JTI=jti-full",
			Cluster:        ref("fleet", "a"),
			ClusterUid:     "uid-a",
			Subject:        &credbrokerv1alpha1.Subject{Username: argocd, Uid: "hub-uid", Groups: []string{"system:serviceaccounts", "team,a"}},
			ServiceAccount: ref("apps", "deployer"),
			Audiences:      []string{"vault", "sts"},
			ExpirationTime: timestamppb.New(issuedAt.Add(30 * time.Minute)),
			Secret:         ref("apps", "full"),
		},
		{
			CredentialId:   "JTI=jti-other",
			Cluster:        ref("fleet", "b"),
			Subject:        &credbrokerv1alpha1.Subject{Username: flux},
			ServiceAccount: ref("tools", "reader"),
			ExpirationTime: timestamppb.New(issuedAt.Add(30 * time.Minute)),
			Secret:         ref("tools", "other"),
		},
	}
	got := m.Snapshot()
	require.Len(t, got, len(want))
	for i := range want {
		assert.True(t, proto.Equal(want[i], got[i]), "grant %d:\nwant %v\ngot  %v", i, want[i], got[i])
	}
}

// recorder collects the updates a subscriber receives.
type recorder struct {
	mu      sync.Mutex
	updates []*credbrokerv1alpha1.GrantUpdate
}

func (r *recorder) fn(u *credbrokerv1alpha1.GrantUpdate) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.updates = append(r.updates, u)
}

// summary is each update as "+id" and "-id" entries.
func (r *recorder) summary() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, u := range r.updates {
		var parts []string
		for _, g := range u.GetAdded() {
			parts = append(parts, "+"+g.GetCredentialId())
		}
		for _, id := range u.GetRemoved() {
			parts = append(parts, "-"+id)
		}
		out = append(out, strings.Join(parts, " "))
	}
	return out
}

func TestSubscribe(t *testing.T) {
	unminted := profileGrant("apps", "g", "deployer", argocd, "fleet/a")
	delete(unminted.Annotations, GrantCredentialIDAnnotation)
	delete(unminted.Labels, GrantJTILabel)
	minted := profileGrant("apps", "g", "deployer", argocd, "fleet/a")
	renewed := minted.DeepCopy()
	renewed.Annotations[GrantExpirationAnnotation] = issuedAt.Add(time.Hour).Format(time.RFC3339)
	relabelled := minted.DeepCopy()
	relabelled.Labels["credbroker.io/unrelated"] = "x"
	stamped := minted.DeepCopy()
	stamped.Labels["team"] = "x"
	stamped.Annotations["example.com/owner"] = "x"
	deleting := minted.DeepCopy()
	deleting.DeletionTimestamp = &metav1.Time{Time: issuedAt}
	deleting.Finalizers = []string{metav1.FinalizerDeleteDependents}
	deletingRewritten := deleting.DeepCopy()
	deletingRewritten.Annotations[GrantCredentialIDAnnotation] = "JTI=other"
	deletingRewritten.Labels[GrantJTILabel] = "other"
	rewritten := minted.DeepCopy()
	rewritten.Annotations[GrantCredentialIDAnnotation] = "JTI=other"
	notAGrant := minted.DeepCopy()
	notAGrant.Type = corev1.SecretTypeOpaque

	tests := []struct {
		name  string
		event func(h cache.ResourceEventHandler)
		want  []string
	}{
		{name: "created without a credential id", event: func(h cache.ResourceEventHandler) { h.OnAdd(unminted, false) }},
		{name: "seen with a credential id", event: func(h cache.ResourceEventHandler) { h.OnAdd(minted, true) }, want: []string{"+JTI=jti-g"}},
		{name: "credential id recorded", event: func(h cache.ResourceEventHandler) { h.OnUpdate(unminted, minted) }, want: []string{"+JTI=jti-g"}},
		{name: "resync", event: func(h cache.ResourceEventHandler) { h.OnUpdate(minted, minted) }},
		// Changes by someone else: the grant is being deleted, and the
		// brokers hear of its removal once it is gone.
		{name: "a label added", event: func(h cache.ResourceEventHandler) { h.OnUpdate(minted, relabelled) }},
		{name: "expiration changed", event: func(h cache.ResourceEventHandler) { h.OnUpdate(minted, renewed) }},
		{name: "credential id rewritten", event: func(h cache.ResourceEventHandler) { h.OnUpdate(minted, rewritten) }},
		{
			name:  "credential id rewritten, then deleted",
			event: func(h cache.ResourceEventHandler) { h.OnUpdate(minted, rewritten); h.OnDelete(rewritten) },
			want:  []string{"-JTI=jti-g"},
		},
		{name: "seen changed", event: func(h cache.ResourceEventHandler) { h.OnAdd(relabelled, true) }},
		{name: "a foreign label and annotation added", event: func(h cache.ResourceEventHandler) { h.OnUpdate(minted, stamped) }},
		{name: "seen with a foreign label and annotation", event: func(h cache.ResourceEventHandler) { h.OnAdd(stamped, true) }, want: []string{"+JTI=jti-g"}},
		{name: "being deleted", event: func(h cache.ResourceEventHandler) { h.OnUpdate(minted, deleting) }},
		{name: "seen being deleted", event: func(h cache.ResourceEventHandler) { h.OnAdd(deleting, true) }},
		{name: "credential id rewritten while being deleted", event: func(h cache.ResourceEventHandler) { h.OnUpdate(deleting, deletingRewritten) }},
		{
			name: "credential id rewritten while being deleted, then deleted",
			event: func(h cache.ResourceEventHandler) {
				h.OnUpdate(deleting, deletingRewritten)
				h.OnDelete(deletingRewritten)
			},
			want: []string{"-JTI=jti-g"},
		},
		{
			name:  "seen changed, then deleted",
			event: func(h cache.ResourceEventHandler) { h.OnAdd(relabelled, true); h.OnDelete(relabelled) },
			want:  []string{"-JTI=jti-g"},
		},
		{name: "deleted", event: func(h cache.ResourceEventHandler) { h.OnDelete(minted) }, want: []string{"-JTI=jti-g"}},
		{
			name: "deleted while the watch was down",
			event: func(h cache.ResourceEventHandler) {
				h.OnDelete(cache.DeletedFinalStateUnknown{Key: "apps/g", Obj: minted})
			},
			want: []string{"-JTI=jti-g"},
		},
		{name: "deleted before its credential id was recorded", event: func(h cache.ResourceEventHandler) { h.OnDelete(unminted) }},
		{name: "not a grant", event: func(h cache.ResourceEventHandler) { h.OnAdd(notAGrant, false); h.OnDelete(notAGrant) }},
		{name: "not a Secret", event: func(h cache.ResourceEventHandler) { h.OnAdd(&corev1.ConfigMap{}, false); h.OnDelete("junk") }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := grantsMinter(t, newFakeGrants())
			var r, gone recorder
			unsubscribe := m.Subscribe(r.fn)
			defer unsubscribe()
			m.Subscribe(gone.fn)() // unsubscribed at once
			tt.event(m.GrantEvents())
			assert.Equal(t, tt.want, r.summary())
			assert.Empty(t, gone.summary(), "an unsubscribed fn was called")
		})
	}
}

// A grant that reaches the cache after the policy change that disallows it
// was reconciled is revoked when it arrives, not at the next sweep.
func TestRunRevokesGrantThatArrivesAfterPolicyChange(t *testing.T) {
	clk := testingclock.NewFakeClock(issuedAt)
	_, sal := cachedServiceAccounts(t, policySA("deployer", flux, ""))
	grants := newFakeGrants()
	m, err := New(withGrants(Config{Tokens: &fakeTokens{}, Clock: clk, CollectInterval: time.Hour, ServiceAccounts: sal}, grants))
	require.NoError(t, err)
	grants.events = m.GrantEvents()
	startRun(t, m, grants, clk)

	// Minted while the cache still allowed argocd; the policy change was
	// reconciled before the grant reached the cache.
	late := grantOf("apps", "late", "deployer", argocd, "")
	grants.mu.Lock()
	grants.secrets["apps/late"] = late.DeepCopy()
	grants.inform(nil, late)
	grants.mu.Unlock()
	require.Eventually(t, func() bool { return len(grants.Deleted()) == 1 }, 5*time.Second, time.Millisecond,
		"a grant the policy no longer allows waits for the next sweep")
	assert.Equal(t, []string{"apps/late"}, grants.Deleted())
}

func TestHubGroupsRoundTrip(t *testing.T) {
	tests := []struct {
		groups []string
		value  string
	}{
		{groups: nil, value: ""},
		{groups: []string{"system:serviceaccounts", "system:authenticated"}, value: "system:serviceaccounts,system:authenticated"},
		{groups: []string{"a,system:masters"}, value: "a%2Csystem:masters"},
		{groups: []string{"100%", "%2C"}, value: "100%25,%252C"},
	}
	for _, tt := range tests {
		assert.Equal(t, tt.value, joinGroups(tt.groups))
		assert.Equal(t, tt.groups, splitGroups(tt.value))
	}
	// Entries the agent would not write are dropped, not decoded.
	assert.Equal(t, []string{"b"}, splitGroups("%41,b,%zz,a%2cb"))
}

// FuzzHubGroups: whatever a spoke admin writes into the annotation, reading
// it never panics and yields only groups that the agent would write back
// as the same entries.
func FuzzHubGroups(f *testing.F) {
	for _, seed := range []string{"", "a,b", "a%2Cb", "%", "%zz", ",,", "100%25"} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, value string) {
		groups := splitGroups(value)
		for _, g := range groups {
			assert.NotEmpty(t, g)
		}
		assert.Equal(t, groups, splitGroups(joinGroups(groups)))
	})
}

// A broker can name at most maxLookups credential ids the cache does not
// know per RevokeRequest; the agent asks the API server about those and
// no more, so one request cannot make it list grants without end. The ids
// past the bound are left out of the answer, for the broker to retry.
func TestRevokeBoundsItsLookups(t *testing.T) {
	grants := newFakeGrants()
	m := grantsMinter(t, grants)
	ids := make([]string, maxLookups+1)
	for i := range ids {
		ids[i] = fmt.Sprintf("JTI=unknown-%d", i)
	}
	resp, err := m.Revoke(t.Context(), admitted("fleet/a"), &credbrokerv1alpha1.RevokeRequest{CredentialIds: ids})
	require.NoError(t, err)
	assert.Equal(t, ids[:maxLookups], grants.Lookups())
	assert.Equal(t, ids[:maxLookups], resp.GetCredentialIds(), "an id found nowhere is gone")
}
