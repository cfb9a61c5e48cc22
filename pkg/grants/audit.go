package grants

import (
	"time"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/grants/selector"
	"github.com/credbroker/credbroker/pkg/hubauth"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// auditRecord collects what one call learned, for its audit line.
type auditRecord struct {
	method   string
	user     *hubauth.User
	selector *pb.GrantSelector
	reason   string
	listed   int
	revoked  []string
	pending  []string
}

// maxAuditIDs bounds the credential ids one audit line lists of each kind.
const maxAuditIDs = 100

// audit writes the call's one audit line. Grants hold no token; what the
// caller sent is clipped, and anything shaped like a token is replaced by
// its fingerprint.
func (s *Service) audit(rec *auditRecord, err error, latency time.Duration) {
	sel := rec.selector
	kv := []any{
		"method", rec.method,
		"selectorCredentialID", selector.Clip(sel.GetCredentialId()),
		"selectorUsername", selector.Clip(sel.GetUsername()),
		"selectorCluster", selector.Clip(refString(sel.GetCluster())),
		"code", errdefs.Code(err).String(),
		"latency", latency.String(),
	}
	if rec.user != nil {
		kv = append(kv, "user", rec.user.Username, "uid", rec.user.UID)
	}
	switch rec.method {
	case "list":
		kv = append(kv, "listed", rec.listed)
	case "revoke":
		kv = append(kv, "revokeReason", selector.Clip(rec.reason), "revoked", firstIDs(rec.revoked), "pending", firstIDs(rec.pending))
	}
	if err != nil {
		kv = append(kv, "reason", err.Error())
	}
	s.cfg.Audit.Info("grants", kv...)
}

func firstIDs(ids []string) []string {
	if len(ids) > maxAuditIDs {
		return append(ids[:maxAuditIDs:maxAuditIDs], "...")
	}
	return ids
}

func refString(r *pb.ObjectReference) string {
	if r == nil {
		return ""
	}
	return r.GetNamespace() + "/" + r.GetName()
}
