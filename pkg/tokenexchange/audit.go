package tokenexchange

import (
	"time"

	"google.golang.org/grpc/codes"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/hubauth"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// auditRecord collects what one exchange learned, for its audit line.
// It holds values, not pointers, so that what it records stays on the
// exchange's stack.
type auditRecord struct {
	user          hubauth.User
	authenticated bool // user is set
	cacheHit      bool
	minted        minted // the checked claims of the token answered
	answered      bool   // minted is set
}

// audit writes the exchange's one audit line, which ended at now, and
// records its metrics. It never writes a token; the minted token appears as
// its credential id, and its ServiceAccount, audiences and expiry are those
// of its checked claims.
func (s *Service) audit(now time.Time, rec *auditRecord, req *pb.ExchangeRequest, err error, latency time.Duration) {
	code := errdefs.Code(err)
	if s.cfg.AuditLog != nil {
		s.writeAuditLine(now, rec, req, code, err, latency)
	} else if s.cfg.Audit.Enabled() {
		s.cfg.Audit.Info("exchange", auditValues(rec, req, code, err, latency)...)
	}
	s.metrics.exchanged(code, rec.cacheHit, latency)
}

// auditValues are the audit line's keys and values for a logr Audit, which
// redacts them (the broker binary's does) or not. appendAuditLine writes
// the same line as JSON.
func auditValues(rec *auditRecord, req *pb.ExchangeRequest, code codes.Code, err error, latency time.Duration) []any {
	// The request is logged as received, before validation: clip it.
	kv := []any{
		"cluster", clip(refString(req.GetCluster())),
		"requestedServiceAccount", clip(refString(req.GetServiceAccount())),
		"audiences", clipAll(req.GetAudiences()),
		"code", code.String(),
		"cacheHit", rec.cacheHit,
		"latency", latency.String(),
	}
	if rec.authenticated {
		kv = append(kv, "user", rec.user.Username, "uid", rec.user.UID)
	}
	if rec.answered {
		// The token's checked claims, not what the agent said beside it.
		kv = append(kv,
			"serviceAccount", rec.minted.serviceAccount.String(),
			"tokenAudiences", clipAll(rec.minted.audiences),
			"expiration", rfc3339(rec.minted.expiry),
			"credentialID", rec.minted.credentialID)
	}
	if err != nil {
		kv = append(kv, "reason", err.Error())
	}
	return kv
}

func refString(r *pb.ObjectReference) string {
	if r == nil {
		return ""
	}
	return r.GetNamespace() + "/" + r.GetName()
}
