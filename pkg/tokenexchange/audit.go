package tokenexchange

import (
	"time"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/hubauth"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// auditRecord collects what one exchange learned, for its audit line.
type auditRecord struct {
	user     *hubauth.User
	cacheHit bool
	minted   *minted // the checked claims of the token answered
}

// audit writes the exchange's one audit line and records its metrics. It
// never writes a token; the minted token appears as its credential id, and
// its ServiceAccount, audiences and expiry are those of its checked claims.
func (s *Service) audit(rec *auditRecord, req *pb.ExchangeRequest, err error, latency time.Duration) {
	code := errdefs.Code(err)
	// The request is logged as received, before validation: clip it.
	kv := []any{
		"cluster", clip(refString(req.GetCluster())),
		"requestedServiceAccount", clip(refString(req.GetServiceAccount())),
		"audiences", clipAll(req.GetAudiences()),
		"code", code.String(),
		"cacheHit", rec.cacheHit,
		"latency", latency.String(),
	}
	if rec.user != nil {
		kv = append(kv, "user", rec.user.Username, "uid", rec.user.UID)
	}
	if rec.minted != nil {
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
	s.cfg.Audit.Info("exchange", kv...)
	s.metrics.exchanges.WithLabelValues(code.String(), cacheLabel(rec.cacheHit)).Inc()
	s.metrics.exchangeDuration.WithLabelValues(code.String()).Observe(latency.Seconds())
}

func refString(r *pb.ObjectReference) string {
	if r == nil {
		return ""
	}
	return r.GetNamespace() + "/" + r.GetName()
}
