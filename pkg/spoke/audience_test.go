package spoke

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// withAudiences sets sa's allowed-audiences annotation to audiences.
func withAudiences(sa *corev1.ServiceAccount, audiences string) *corev1.ServiceAccount {
	if sa.Annotations == nil {
		sa.Annotations = map[string]string{}
	}
	sa.Annotations["credbroker.io/allowed-audiences"] = audiences
	return sa
}

// A consumer allowed on a spoke ServiceAccount that a cloud trusts (IRSA,
// workload identity, Vault JWT auth) must not get a token for the cloud's
// audience unless the spoke admin lists it.
func TestMintAudiencePolicy(t *testing.T) {
	const sts = "sts.amazonaws.com"
	sas := []*corev1.ServiceAccount{
		serviceAccount("apps", "plain", argocd),
		withAudiences(serviceAccount("apps", "irsa", argocd), " "+sts+" ,, vault,"),
		withAudiences(serviceAccount("apps", "blank", flux), " , "),
		withAudiences(serviceAccount("team-a", "only", "alice"), "vault"),
	}
	tests := []struct {
		name      string
		req       *credbrokerv1alpha1.MintRequest
		wantSA    *credbrokerv1alpha1.ObjectReference
		wantAud   []string
		wantErr   string
		wantError error
	}{
		{
			name:   "no audiences: the API server's default, allowed without the annotation",
			req:    &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref("apps", "plain")},
			wantSA: ref("apps", "plain"),
		},
		{
			name:      "cloud audience without the annotation",
			req:       &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref("apps", "plain"), Audiences: []string{sts}},
			wantErr:   `spoke ServiceAccount apps/plain does not allow audience "sts.amazonaws.com"; a spoke admin must add it to its credbroker.io/allowed-audiences annotation: permission denied`,
			wantError: errdefs.ErrPermissionDenied,
		},
		{
			name:    "listed audience",
			req:     &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref("apps", "irsa"), Audiences: []string{sts}},
			wantSA:  ref("apps", "irsa"),
			wantAud: []string{sts},
		},
		{
			name:    "every listed audience at once",
			req:     &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref("apps", "irsa"), Audiences: []string{"vault", sts}},
			wantSA:  ref("apps", "irsa"),
			wantAud: []string{"vault", sts},
		},
		{
			name:      "one listed audience and one not",
			req:       &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref("apps", "irsa"), Audiences: []string{sts, "https://attacker.example"}},
			wantErr:   `spoke ServiceAccount apps/irsa does not allow audience "https://attacker.example"; a spoke admin must add it to its credbroker.io/allowed-audiences annotation: permission denied`,
			wantError: errdefs.ErrPermissionDenied,
		},
		{
			name:      "match is exact: no case folding or prefixes",
			req:       &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref("apps", "irsa"), Audiences: []string{"STS.amazonaws.com"}},
			wantErr:   `spoke ServiceAccount apps/irsa does not allow audience "STS.amazonaws.com"; a spoke admin must add it to its credbroker.io/allowed-audiences annotation: permission denied`,
			wantError: errdefs.ErrPermissionDenied,
		},
		{
			name:      "an annotation of only separators allows nothing",
			req:       &credbrokerv1alpha1.MintRequest{Subject: subject(flux), ServiceAccount: ref("apps", "blank"), Audiences: []string{" "}},
			wantErr:   `spoke ServiceAccount apps/blank does not allow audience " "; a spoke admin must add it to its credbroker.io/allowed-audiences annotation: permission denied`,
			wantError: errdefs.ErrPermissionDenied,
		},
		{
			name:      "the agent picks the ServiceAccount as before, then checks audiences",
			req:       &credbrokerv1alpha1.MintRequest{Subject: subject("alice"), Audiences: []string{sts}},
			wantErr:   `spoke ServiceAccount team-a/only does not allow audience "sts.amazonaws.com"; a spoke admin must add it to its credbroker.io/allowed-audiences annotation: permission denied`,
			wantError: errdefs.ErrPermissionDenied,
		},
		{
			name:    "the agent picks, and the audience is listed",
			req:     &credbrokerv1alpha1.MintRequest{Subject: subject("alice"), Audiences: []string{"vault"}},
			wantSA:  ref("team-a", "only"),
			wantAud: []string{"vault"},
		},
		{
			// Audiences do not decide which ServiceAccount is picked: argocd
			// is allowed on two, so it must name one even though only one
			// lists the audience.
			name:      "audiences do not disambiguate the pick",
			req:       &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), Audiences: []string{sts}},
			wantErr:   "several spoke ServiceAccounts allow hub user " + argocd + " (apps/irsa, apps/plain); name one in the request: failed precondition",
			wantError: errdefs.ErrFailedPrecondition,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tokens := &fakeTokens{}
			m := newMinter(t, tokens, sas...)
			resp, err := m.Mint(t.Context(), fleet.ClusterRef{}, tt.req)
			if tt.wantErr != "" {
				requireRefused(t, tokens, resp, err, tt.wantErr, tt.wantError)
				return
			}
			require.NoError(t, err)
			calls := tokens.Calls()
			require.Len(t, calls, 1)
			assert.Equal(t, tt.wantSA.GetNamespace()+"/"+tt.wantSA.GetName(), calls[0].namespace+"/"+calls[0].name)
			assert.Equal(t, tt.wantAud, calls[0].req.Spec.Audiences)
		})
	}
}

func TestAllowedAudiences(t *testing.T) {
	annotated := func(v string) *corev1.ServiceAccount {
		return &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{"credbroker.io/allowed-audiences": v}}}
	}
	tests := []struct {
		name string
		sa   *corev1.ServiceAccount
		want []string
	}{
		{name: "nil", sa: nil, want: nil},
		{name: "no annotations", sa: serviceAccount("a", "b", argocd), want: nil},
		{name: "empty", sa: annotated(""), want: nil},
		{name: "only separators and spaces", sa: annotated(" , ,\t,"), want: nil},
		{name: "one", sa: annotated("sts.amazonaws.com"), want: []string{"sts.amazonaws.com"}},
		{name: "several, trimmed, empties dropped, order kept", sa: annotated(" vault ,, https://x.example,\nargocd ,"), want: []string{"vault", "https://x.example", "argocd"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, AllowedAudiences(tt.sa))
		})
	}
}
