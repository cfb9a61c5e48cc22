package tokenexchange

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The audit line quotes a refused request's audiences as received, but
// clipped: at most maxAudiences of them, each at most 64 bytes and "...".
func TestAuditClipsRequestedAudiences(t *testing.T) {
	f := newFixture(t)
	req := fleetA()
	req.Audiences = []string{strings.Repeat("a", 300)}
	for range maxAudiences + 4 {
		req.Audiences = append(req.Audiences, "b")
	}
	_, err := f.svc.Exchange(withBearer(consumerToken), req)
	require.Equal(t, codes.InvalidArgument, status.Code(err))

	want := `"audiences"=["` + strings.Repeat("a", 64) + `..."` + strings.Repeat(` "b"`, maxAudiences-1) + `]`
	assert.Contains(t, f.audit.String(), want)
	assert.NotContains(t, f.audit.String(), strings.Repeat("a", 65))
}
