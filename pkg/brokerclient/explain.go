package brokerclient

import (
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Role and annotation examples that the hints name, relative to the
// repository root.
const (
	consumerRBACExample   = "deploy/examples/consumer-rbac.yaml"
	spokeAccountExample   = "deploy/examples/spoke-serviceaccount.yaml"
	hubRBACMessagePrefix  = "hub RBAC"
	createHubTokenCommand = "kubectl create token NAME --audience credbroker"
	// The agent's refusals of an escalating spoke ServiceAccount name this
	// flag, and those of a mint whose grant went name this phrase.
	escalationFlag      = "--allow-escalating-service-accounts"
	grantDeletedMessage = "was deleted while the token was minted"
)

// codeWords are the gRPC codes as a person reads them.
var codeWords = map[codes.Code]string{
	codes.OK:                 "ok",
	codes.Canceled:           "canceled",
	codes.Unknown:            "unknown error",
	codes.InvalidArgument:    "invalid argument",
	codes.DeadlineExceeded:   "deadline exceeded",
	codes.NotFound:           "not found",
	codes.AlreadyExists:      "already exists",
	codes.PermissionDenied:   "permission denied",
	codes.ResourceExhausted:  "resource exhausted",
	codes.FailedPrecondition: "failed precondition",
	codes.Aborted:            "aborted",
	codes.OutOfRange:         "out of range",
	codes.Unimplemented:      "unimplemented",
	codes.Internal:           "internal error",
	codes.Unavailable:        "unavailable",
	codes.DataLoss:           "data loss",
	codes.Unauthenticated:    "unauthenticated",
}

// CodeWords returns code as a person reads it, such as "permission denied".
func CodeWords(code codes.Code) string {
	if w, ok := codeWords[code]; ok {
		return w
	}
	return strings.ToLower(code.String())
}

// Hint returns what to do about a call the broker refused with code and
// msg: one clause, without a trailing period, naming the flag, the RBAC
// or the annotation to fix. It returns "" for OK.
func Hint(code codes.Code, msg string) string {
	switch code {
	case codes.OK:
		return ""
	case codes.Unauthenticated:
		return "the broker did not accept the hub token: put a current ServiceAccount token for the audience " +
			"\"credbroker\" in --token-file (" + createHubTokenCommand + ", or a projected token in a pod)"
	case codes.PermissionDenied:
		switch {
		case strings.Contains(msg, hubRBACMessagePrefix):
			return "grant it with a Role like " + consumerRBACExample
		case strings.Contains(msg, escalationFlag):
			return "the spoke ServiceAccount may mint tokens or impersonate, so a token for it could outlive its grant: " +
				"ask the spoke's admin to narrow its RBAC, or to allow it with the agent's " + escalationFlag
		case strings.Contains(msg, grantDeletedMessage):
			return "the token was revoked while it was minted: run it again"
		}
		return "ask the spoke's admin to list you in the credbroker.io/allowed-subjects annotation of a spoke " +
			"ServiceAccount, like " + spokeAccountExample
	case codes.NotFound:
		return "check --cluster names a ClusterProfile on the hub (kubectl get clusterprofiles -A) and " +
			"--service-account a ServiceAccount on the spoke"
	case codes.InvalidArgument, codes.OutOfRange:
		return "fix the value the message names (see --help)"
	case codes.FailedPrecondition:
		return "do what the message asks; when several spoke ServiceAccounts allow you, pick one with --service-account"
	case codes.ResourceExhausted:
		return "too many requests: wait as long as the message says, then run it again"
	case codes.Unavailable:
		return "check --broker-address and --ca-file, that the broker runs, and that the cluster's agent is connected " +
			"(kubectl get clusterprofile shows its CredentialBrokerConnected condition when the broker publishes it); then run it again"
	case codes.DeadlineExceeded:
		return "the broker or the cluster's agent did not answer in time: run it again, or raise --timeout"
	case codes.Canceled, codes.Aborted:
		return "the call was cut short: run it again"
	case codes.Unimplemented:
		return "the broker does not serve this call: run a broker as new as this client"
	case codes.AlreadyExists:
		return "the object exists already: use it, or remove it first"
	default: // Unknown, Internal, DataLoss and codes this client does not know
		return "the broker's log has the detail: tell the broker's operators"
	}
}

// Explain turns a failed call into one line a person can act on:
// "<code in words>: <broker's message>; <what to do>". Line breaks in the
// message become spaces, and a trailing ": <code in words>" that repeats the
// code is dropped. Errors that are not gRPC statuses read as Unknown.
func Explain(err error) string {
	st := status.Convert(err)
	return ExplainStatus(st.Code(), st.Message())
}

// ExplainStatus is Explain for a code and message.
func ExplainStatus(code codes.Code, msg string) string {
	words := CodeWords(code)
	msg = strings.Join(strings.Fields(msg), " ")
	msg = strings.TrimSuffix(msg, ": "+words)
	line := words
	if msg != "" && msg != words {
		line += ": " + msg
	}
	if h := Hint(code, msg); h != "" {
		line += "; " + h
	}
	return line
}
