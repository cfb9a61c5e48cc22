package tokenexchange

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"k8s.io/apimachinery/pkg/types"

	"github.com/credbroker/credbroker/internal/cmdflags"
	"github.com/credbroker/credbroker/pkg/hubauth"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// The attack on the audit path's shortcut (the binary's audit logger skips
// the token scan of values the service formats itself): a token, or a
// segment of one, in every field of the exchange's audit line that a caller
// or an agent controls: the request's cluster, ServiceAccount and
// audiences, the user and uid the hub reported for the caller's token, the
// agent's answer (its ServiceAccount, audiences and credential id) and the
// refusal's reason. None of them reaches the audit log.
func TestAuditLineRedactsEveryControlledField(t *testing.T) {
	const seg = "eyJhbGciOiJSUzI1NiIsImtpZCI6ImF0dGFja2VyLWNvbnRyb2xsZWQta2V5LWlkIn0"
	f := newFixture(t)
	var buf strings.Builder
	f.svc.cfg.Audit = cmdflags.AuditLogger(&buf)

	field := func(name string) string { return seg + name }
	req := &pb.ExchangeRequest{
		Cluster:        &pb.ObjectReference{Namespace: field("clusterNS"), Name: field("clusterName")},
		ServiceAccount: &pb.ObjectReference{Namespace: field("saNS"), Name: field("saName")},
		Audiences:      []string{field("aud")},
	}
	rec := &auditRecord{
		user: &hubauth.User{Username: field("user"), UID: field("uid")},
		minted: &minted{
			serviceAccount: types.NamespacedName{Namespace: field("mintedNS"), Name: field("mintedName")},
			audiences:      []string{field("mintedAud")},
			expiry:         t0,
			credentialID:   "JTI=" + field("jti"),
		},
	}
	err := fmt.Errorf("the agent refused %q: %w", field("reason"), errors.New("denied"))
	f.svc.audit(t0, rec, req, err, time.Millisecond)

	out := buf.String()
	assert.NotContains(t, out, seg[:24], "a token segment reached the audit line: %s", out)
	// Every field was written, redacted.
	for _, key := range []string{"cluster", "requestedServiceAccount", "audiences", "user", "uid", "serviceAccount",
		"tokenAudiences", "credentialID", "reason"} {
		assert.Contains(t, out, `"`+key+`":`, key)
	}
	assert.Equal(t, 10, strings.Count(out, "[redacted sha256:"), out)
}
