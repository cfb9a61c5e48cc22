package brokerclient

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/credbroker/credbroker/pkg/errdefs"
)

// Every code the broker sends (every errdefs sentinel, and Internal for the
// rest) and every other gRPC code reads as one line that names the code, keeps
// the broker's message and says what to fix.
func TestExplain(t *testing.T) {
	hubRBAC := fmt.Errorf(`hub RBAC does not allow "system:serviceaccount:argocd:controller" to create `+
		`multicluster.x-k8s.io/clusterprofiles/token "prod-eu-1" in namespace "fleet": %w`, errdefs.ErrPermissionDenied)
	for _, tc := range []struct {
		name string
		err  error // as the broker makes it: errdefs.ToStatus turns it into the status
		want []string
	}{
		{name: "hub RBAC", err: hubRBAC, want: []string{
			`permission denied: hub RBAC does not allow "system:serviceaccount:argocd:controller" to create ` +
				`multicluster.x-k8s.io/clusterprofiles/token "prod-eu-1" in namespace "fleet"; grant it with a Role like deploy/examples/consumer-rbac.yaml`}},
		{name: "spoke policy", err: fmt.Errorf("no spoke ServiceAccount allows you: %w", errdefs.ErrPermissionDenied),
			want: []string{"permission denied: no spoke ServiceAccount allows you; ", "credbroker.io/allowed-subjects", "deploy/examples/spoke-serviceaccount.yaml"}},
		{name: "escalating spoke ServiceAccount", err: fmt.Errorf("spoke ServiceAccount apps/deployer may create serviceaccounts/token in namespace apps, "+
			"so a token for it could make itself a credential that no grant binds and no revoke ends; remove that from its RBAC, "+
			"or a spoke admin must allow it with the agent's --allow-escalating-service-accounts=apps/deployer: %w", errdefs.ErrPermissionDenied),
			want: []string{"permission denied: spoke ServiceAccount apps/deployer may create", "narrow its RBAC"}},
		{name: "grant deleted during the mint", err: fmt.Errorf("the grant apps/credbroker-grant-x of the token for spoke ServiceAccount apps/deployer "+
			"was deleted while the token was minted, which revokes the token; ask again: %w", errdefs.ErrPermissionDenied),
			want: []string{"permission denied: the grant", "run it again"}},
		{name: "unauthenticated", err: fmt.Errorf("token expired: %w", errdefs.ErrUnauthenticated),
			want: []string{"unauthenticated: token expired; ", "--token-file", "kubectl create token NAME --audience credbroker"}},
		{name: "not found", err: fmt.Errorf("ClusterProfile fleet/x not found: %w", errdefs.ErrNotFound),
			want: []string{"not found: ClusterProfile fleet/x not found; ", "--cluster", "kubectl get clusterprofiles"}},
		{name: "invalid argument", err: fmt.Errorf("audience too long: %w", errdefs.ErrInvalidArgument),
			want: []string{"invalid argument: audience too long; fix the value"}},
		{name: "failed precondition", err: fmt.Errorf("2 ServiceAccounts allow you: %w", errdefs.ErrFailedPrecondition),
			want: []string{"failed precondition: 2 ServiceAccounts allow you; ", "--service-account"}},
		{name: "unavailable", err: fmt.Errorf("no agent of fleet/x is connected: %w", errdefs.ErrUnavailable),
			want: []string{"unavailable: no agent of fleet/x is connected; ", "--broker-address", "agent is connected"}},
		{name: "deadline exceeded", err: fmt.Errorf("agent did not answer: %w", errdefs.ErrDeadlineExceeded),
			want: []string{"deadline exceeded: agent did not answer; ", "--timeout"}},
		{name: "resource exhausted", err: fmt.Errorf("retry in 3s: %w", errdefs.ErrResourceExhausted),
			want: []string{"resource exhausted: retry in 3s; ", "wait"}},
		{name: "internal", err: errors.New("etcd exploded"),
			want: []string{"internal error: " + errdefs.InternalMessage + "; ", "operators"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := Explain(errdefs.ToStatus(tc.err).Err())
			for _, w := range tc.want {
				assert.Contains(t, got, w)
			}
			assert.NotContains(t, got, "\n")
		})
	}
}

// Every gRPC code, the errdefs ones among them, gets its own words and a
// hint; none is left to the default but those meant for the broker's log.
func TestExplainEveryCode(t *testing.T) {
	for c := codes.Canceled; c <= codes.Unauthenticated; c++ {
		t.Run(c.String(), func(t *testing.T) {
			got := ExplainStatus(c, "line one\nline two")
			assert.NotContains(t, got, "\n")
			assert.True(t, strings.HasPrefix(got, CodeWords(c)+": line one line two; "), got)
			assert.NotEmpty(t, Hint(c, ""))
			assert.NotEqual(t, strings.ToLower(c.String()), "", "code words")
		})
	}
	assert.Equal(t, "ok", ExplainStatus(codes.OK, ""))
	assert.Equal(t, "code(99): x; the broker's log has the detail: tell the broker's operators", ExplainStatus(codes.Code(99), "x"))
	// A plain error, such as a failed dial, reads as unknown.
	assert.True(t, strings.HasPrefix(Explain(errors.New("dial failed")), "unknown error: dial failed; "))
	assert.Equal(t, "unavailable; "+Hint(codes.Unavailable, ""), Explain(status.Error(codes.Unavailable, "")))
}
