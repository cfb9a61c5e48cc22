package selector_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/grants/selector"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

func TestCheck(t *testing.T) {
	tests := []struct {
		name    string
		sel     *pb.GrantSelector
		wantErr string
	}{
		{name: "nil selects everything", sel: nil},
		{name: "every field", sel: &pb.GrantSelector{CredentialId: "JTI=a1", Username: "system:serviceaccount:argocd:app", Cluster: &pb.ObjectReference{Namespace: "fleet", Name: "prod-eu-1"}}},
		{name: "a fingerprint is no credential id", sel: &pb.GrantSelector{CredentialId: "sha256:abc"},
			wantErr: `invalid selector: credential id "sha256:abc" is not of the form JTI=<jti> (1 to 128 printable ASCII characters), as 'credbroker grants list' shows it: invalid argument`},
		{name: "an empty jti", sel: &pb.GrantSelector{CredentialId: "JTI="},
			wantErr: `invalid selector: credential id "JTI=" is not of the form JTI=<jti> (1 to 128 printable ASCII characters), as 'credbroker grants list' shows it: invalid argument`},
		{name: "a username with surrounding spaces", sel: &pb.GrantSelector{Username: " alice"},
			wantErr: `invalid selector: username " alice" is longer than 1024 bytes, or has control characters or surrounding spaces: invalid argument`},
		{name: "a cluster without a name", sel: &pb.GrantSelector{Cluster: &pb.ObjectReference{Namespace: "fleet"}},
			wantErr: `invalid selector: cluster "fleet/" needs both a namespace and a name: invalid argument`},
		{name: "two faults", sel: &pb.GrantSelector{Username: "a\nb", Cluster: &pb.ObjectReference{Namespace: "Fleet", Name: "p"}},
			wantErr: `invalid selector: username "a\nb" is longer than 1024 bytes, or has control characters or surrounding spaces; ` +
				`cluster namespace "Fleet" is not a valid namespace (an RFC 1123 label): invalid argument`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := selector.Check(tt.sel)
			if tt.wantErr == "" {
				assert.NoError(t, err)
				return
			}
			assert.EqualError(t, err, tt.wantErr)
			assert.True(t, errors.Is(err, errdefs.ErrInvalidArgument))
		})
	}
}

func TestIsCredentialID(t *testing.T) {
	assert.True(t, selector.IsCredentialID("JTI="+strings.Repeat("a", selector.MaxJTILength)))
	for _, id := range []string{"", "JTI=", "jti=a", "JTI=a b", "JTI=" + strings.Repeat("a", selector.MaxJTILength+1)} {
		assert.False(t, selector.IsCredentialID(id), id)
	}
}

// Attack: a caller pastes a token into a selector, which the audit log and
// the error message would repeat.
// Defence: Clip names a token by its fingerprint.
func TestClip(t *testing.T) {
	tok := "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJhIn0.c2lnbmF0dXJl"
	assert.NotContains(t, selector.Clip(tok), "eyJ")
	assert.Equal(t, strings.Repeat("x", 64)+"...", selector.Clip(strings.Repeat("x", 65)))
	assert.Equal(t, "fleet/prod", selector.Clip("fleet/prod"))
}
