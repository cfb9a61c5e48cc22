package spoke

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

const argocdGroup = "system:serviceaccounts:argocd"

// hubSubject is a hub subject with username user and groups, as the
// broker's TokenReview reports them.
func hubSubject(user string, groups ...string) *credbrokerv1alpha1.Subject {
	return &credbrokerv1alpha1.Subject{Username: user, Uid: "hub-uid", Groups: groups}
}

// The attack: a hub subject gets a spoke token through a group entry it is
// not in, or a username or wildcard is read as a group. A group:<name>
// entry matches exactly the groups the hub's TokenReview reported; a plain
// entry matches exactly the username; nothing else matches.
func TestMintGroupSubjects(t *testing.T) {
	sas := []*corev1.ServiceAccount{
		serviceAccount("apps", "by-group", "group:"+argocdGroup),
		serviceAccount("apps", "empty-group", "group:, group: ,group:"),
		serviceAccount("apps", "plain-group-name", argocdGroup),
		serviceAccount("apps", "looks-like-group", "group:mallory"),
		serviceAccount("apps", "star", "*, group:*, group:system:serviceaccounts:*"),
		serviceAccount("apps", "case", "GROUP:"+argocdGroup+", group:SYSTEM:SERVICEACCOUNTS:ARGOCD"),
		serviceAccount("apps", "prefix", "group:system:serviceaccounts:argo"),
		serviceAccount("shared", "by-name", "alice"),
		serviceAccount("shared", "by-team", "group:team-a"),
	}
	tests := []struct {
		name     string
		req      *credbrokerv1alpha1.MintRequest
		wantSA   *credbrokerv1alpha1.ObjectReference
		wantCode error
	}{
		{
			name:   "a group entry allows a subject in that group",
			req:    &credbrokerv1alpha1.MintRequest{Subject: hubSubject(argocd, "system:authenticated", argocdGroup), ServiceAccount: ref("apps", "by-group")},
			wantSA: ref("apps", "by-group"),
		},
		{
			name:     "a group entry refuses a subject not in that group",
			req:      &credbrokerv1alpha1.MintRequest{Subject: hubSubject(flux, "system:authenticated", "system:serviceaccounts:flux-system"), ServiceAccount: ref("apps", "by-group")},
			wantCode: errdefs.ErrPermissionDenied,
		},
		{
			name:     "a group entry refuses a subject with no groups",
			req:      &credbrokerv1alpha1.MintRequest{Subject: hubSubject(argocd), ServiceAccount: ref("apps", "by-group")},
			wantCode: errdefs.ErrPermissionDenied,
		},
		{
			name:     "a group entry does not match the group's name as a username",
			req:      &credbrokerv1alpha1.MintRequest{Subject: hubSubject(argocdGroup), ServiceAccount: ref("apps", "by-group")},
			wantCode: errdefs.ErrPermissionDenied,
		},
		{
			name:     "group: with an empty name matches nothing, not even an empty group",
			req:      &credbrokerv1alpha1.MintRequest{Subject: hubSubject(argocd, "", " ", argocdGroup), ServiceAccount: ref("apps", "empty-group")},
			wantCode: errdefs.ErrPermissionDenied,
		},
		{
			name:     "a plain entry never matches a group",
			req:      &credbrokerv1alpha1.MintRequest{Subject: hubSubject(argocd, argocdGroup), ServiceAccount: ref("apps", "plain-group-name")},
			wantCode: errdefs.ErrPermissionDenied,
		},
		{
			name:     "a username that looks like group:x is not in group x",
			req:      &credbrokerv1alpha1.MintRequest{Subject: hubSubject("group:mallory", "system:authenticated"), ServiceAccount: ref("apps", "looks-like-group")},
			wantCode: errdefs.ErrPermissionDenied,
		},
		{
			name:     "a group named like a group entry is not that entry's group",
			req:      &credbrokerv1alpha1.MintRequest{Subject: hubSubject("bob", "group:mallory"), ServiceAccount: ref("apps", "looks-like-group")},
			wantCode: errdefs.ErrPermissionDenied,
		},
		{
			name:     "* is not a wildcard, for users or groups",
			req:      &credbrokerv1alpha1.MintRequest{Subject: hubSubject(argocd, "system:authenticated", argocdGroup), ServiceAccount: ref("apps", "star")},
			wantCode: errdefs.ErrPermissionDenied,
		},
		{
			name:     "group names match exactly: no case folding",
			req:      &credbrokerv1alpha1.MintRequest{Subject: hubSubject(argocd, argocdGroup), ServiceAccount: ref("apps", "case")},
			wantCode: errdefs.ErrPermissionDenied,
		},
		{
			name:     "group names match exactly: no prefixes",
			req:      &credbrokerv1alpha1.MintRequest{Subject: hubSubject(argocd, argocdGroup), ServiceAccount: ref("apps", "prefix")},
			wantCode: errdefs.ErrPermissionDenied,
		},
		{
			name:   "unnamed: the single ServiceAccount that allows one of the subject's groups",
			req:    &credbrokerv1alpha1.MintRequest{Subject: hubSubject("bob", "team-a")},
			wantSA: ref("shared", "by-team"),
		},
		{
			name:     "unnamed: allowed by name by one and by group by another is ambiguous",
			req:      &credbrokerv1alpha1.MintRequest{Subject: hubSubject("alice", "team-a")},
			wantCode: errdefs.ErrFailedPrecondition,
		},
		{
			name:   "ambiguity is resolved by naming one",
			req:    &credbrokerv1alpha1.MintRequest{Subject: hubSubject("alice", "team-a"), ServiceAccount: ref("shared", "by-team")},
			wantSA: ref("shared", "by-team"),
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tokens := &fakeTokens{}
			m := newMinter(t, tokens, sas...)
			resp, err := m.Mint(t.Context(), fleet.ClusterRef{}, tt.req)
			if tt.wantCode != nil {
				require.ErrorIs(t, err, tt.wantCode)
				assert.Nil(t, resp)
				assert.Empty(t, tokens.Calls(), "a refused request must not reach the TokenRequest API")
				return
			}
			require.NoError(t, err)
			calls := tokens.Calls()
			require.Len(t, calls, 1)
			assert.Equal(t, tt.wantSA.GetNamespace(), calls[0].namespace)
			assert.Equal(t, tt.wantSA.GetName(), calls[0].name)
			assert.Equal(t, tt.wantSA.GetNamespace(), resp.GetServiceAccount().GetNamespace())
			assert.Equal(t, tt.wantSA.GetName(), resp.GetServiceAccount().GetName())
		})
	}
}

// The attack: a spoke admin removes a group entry, and the tokens minted
// because the subject was in that group keep working. Reconcile must judge
// each grant by the groups it recorded, as Mint judged the request.
func TestReconcileRevokesGrantsAllowedOnlyByGroup(t *testing.T) {
	withGroups := func(g *corev1.Secret, groups ...string) *corev1.Secret {
		g.Annotations[GrantHubGroupsAnnotation] = joinGroups(groups)
		return g
	}
	grants := func() []*corev1.Secret {
		return []*corev1.Secret{
			withGroups(grantOf("apps", "argocd-by-group", "deployer", argocd, ""), "system:authenticated", argocdGroup),
			withGroups(grantOf("apps", "flux-by-name", "deployer", flux, ""), "system:authenticated", "system:serviceaccounts:flux-system"),
			withGroups(grantOf("apps", "team-comma", "deployer", "carol", ""), "team,a"),
			withGroups(grantOf("apps", "no-groups", "deployer", "dave", "")),
		}
	}
	tests := []struct {
		name    string
		sa      *corev1.ServiceAccount
		revoked []string
	}{
		{
			name: "nothing withdrawn: grants allowed by a recorded group stay",
			sa:   policySA("deployer", "group:"+argocdGroup+","+flux+",dave,group:team%2Ca", ""),
			// A group with a comma cannot be listed: the annotation splits
			// at commas, and entries are not unescaped.
			revoked: []string{"apps/team-comma"},
		},
		{
			name:    "group entry removed",
			sa:      policySA("deployer", flux+",dave", ""),
			revoked: []string{"apps/argocd-by-group", "apps/team-comma"},
		},
		{
			name:    "group entry replaced by the group's name as a plain entry",
			sa:      policySA("deployer", argocdGroup+","+flux+",dave", ""),
			revoked: []string{"apps/argocd-by-group", "apps/team-comma"},
		},
		{
			name:    "a group entry that none of the grants' groups match",
			sa:      policySA("deployer", "group:system:serviceaccounts:flux-system", ""),
			revoked: []string{"apps/argocd-by-group", "apps/team-comma", "apps/no-groups"},
		},
		{
			name:    "a group entry keeps the grants of its group's members, whatever their names",
			sa:      policySA("deployer", "group:system:authenticated", ""),
			revoked: []string{"apps/team-comma", "apps/no-groups"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, sal := cachedServiceAccounts(t, tt.sa)
			fg := newFakeGrants(grants()...)
			m, err := New(Config{Tokens: &fakeTokens{}, Grants: fg, GrantCache: fg.cache, ServiceAccounts: sal})
			require.NoError(t, err)
			require.NoError(t, m.Reconcile(t.Context(), "apps", "deployer"))
			assert.ElementsMatch(t, tt.revoked, fg.Deleted())
		})
	}
}

// allows is the policy check every path shares: Mint's pick and recheck,
// Reconcile and the sweep.
func TestAllows(t *testing.T) {
	tests := []struct {
		name    string
		allowed string
		user    string
		groups  []string
		want    bool
	}{
		{name: "username listed", allowed: argocd, user: argocd, want: true},
		{name: "group listed, subject in it", allowed: "group:" + argocdGroup, user: argocd, groups: []string{"system:authenticated", argocdGroup}, want: true},
		{name: "group listed among names, with spaces", allowed: "alice, group:" + argocdGroup + " ,bob", user: "carol", groups: []string{argocdGroup}, want: true},
		{name: "group listed, subject not in it", allowed: "group:" + argocdGroup, user: argocd, groups: []string{"system:serviceaccounts:flux-system"}},
		{name: "group listed, subject in no group", allowed: "group:" + argocdGroup, user: argocd},
		{name: "group listed, the group's name as the username", allowed: "group:" + argocdGroup, user: argocdGroup},
		{name: "empty group name, subject with an empty group", allowed: "group:", user: argocd, groups: []string{""}},
		{name: "empty group name, subject in groups", allowed: "group:", user: argocd, groups: []string{argocdGroup, "system:authenticated"}},
		{name: "empty group name, username group:", allowed: "group:", user: "group:"},
		{name: "username that looks like a group entry", allowed: "group:x", user: "group:x"},
		{name: "username that looks like a group entry, in group x", allowed: "group:x", user: "group:x", groups: []string{"x"}, want: true},
		{name: "group named like a group entry", allowed: "group:x", user: "bob", groups: []string{"group:x"}},
		{name: "plain entry never matches a group", allowed: argocdGroup, user: argocd, groups: []string{argocdGroup}},
		{name: "* is literal, as a name", allowed: "*", user: argocd, groups: []string{argocdGroup}},
		{name: "* is literal, as a group", allowed: "group:*", user: argocd, groups: []string{argocdGroup}},
		{name: "* is literal, but matches a group named *", allowed: "group:*", user: argocd, groups: []string{"*"}, want: true},
		{name: "no prefix match", allowed: "group:system:serviceaccounts", user: argocd, groups: []string{argocdGroup}},
		{name: "no case folding of the prefix", allowed: "GROUP:" + argocdGroup, user: argocd, groups: []string{argocdGroup}},
		{name: "no case folding of the group", allowed: "group:System:ServiceAccounts:argocd", user: argocd, groups: []string{argocdGroup}},
		{name: "no annotation", user: argocd, groups: []string{argocdGroup}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, allows(serviceAccount("apps", "deployer", tt.allowed), tt.user, tt.groups))
		})
	}
}
