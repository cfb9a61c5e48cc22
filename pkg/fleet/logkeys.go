package fleet

// The keys of the operational log lines that more than one package writes,
// so that every side spells them alike and a search by key finds them all.
// A package that does not import fleet for anything else spells the same
// string (see docs/conventions.md); the audit lines are records of their
// own and keep their keys in their audit.go.
const (
	// LogErr holds a Go error's text: the key that logr's Error writes in
	// both of the binaries' sinks (klog's text logger and log/slog).
	LogErr = "err"
	// LogReason holds why something was done or refused, in words that a
	// caller or the code chose, such as a revoke's reason; never an error.
	LogReason = "reason"

	LogCluster      = "cluster"
	LogAgent        = "agent"
	LogBroker       = "broker"
	LogAddress      = "address"
	LogCredentialID = "credentialID"
	LogSubject      = "subject"
	LogGrants       = "grants"
	LogHolder       = "holder"
	LogIgnored      = "ignored"
	LogReview       = "review"
	LogAdmittedFor  = "admittedFor"
	LogSVIDExpires  = "svidExpires"
)
