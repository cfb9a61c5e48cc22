package tokenexchange

import (
	"strconv"
	"sync"
	"time"
	"unicode/utf8"

	"google.golang.org/grpc/codes"

	"github.com/credbroker/credbroker/pkg/token"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// The exchange's audit line, encoded without logr, slog or reflection into
// a pooled buffer, as the JSON object that the broker binary's slog audit
// logger (cmdflags.AuditLogger) wrote for it: the same keys in the same
// order, the same value formats, the same escapes. Redaction is by
// construction: the values the service formats (the time, the code, the
// latency, the expiry, cacheHit) are appended as they are, and every string
// a caller, the hub's TokenReview or an agent chose only through
// appendString, appendPair, appendRef or appendStrings, which pass it
// through token.AppendRedacted while they escape it.

// auditBuffers holds the buffers of audit lines. One larger than
// maxPooledAudit (a refusal's long reason) is left to the collector.
var auditBuffers = sync.Pool{New: func() any { b := make([]byte, 0, 1024); return &b }}

const maxPooledAudit = 16 << 10

// writeAuditLine writes the exchange's audit line to s.cfg.AuditLog with
// one Write, as the audit log's modes expect (blocking: one write(2) per
// line; batch: a line is never split).
func (s *Service) writeAuditLine(now time.Time, rec *auditRecord, req *pb.ExchangeRequest, code codes.Code, err error, latency time.Duration) {
	bp := auditBuffers.Get().(*[]byte)
	line := appendAuditLine((*bp)[:0], now, rec, req, code, err, latency)
	// As the slog handler did, a failed write is not the exchange's
	// failure; the batch writer reports its own.
	_, _ = s.cfg.AuditLog.Write(line)
	if cap(line) <= maxPooledAudit {
		*bp = line
		auditBuffers.Put(bp)
	}
}

// appendAuditLine appends the exchange's audit line, a JSON object and a
// newline, to dst. The request is quoted as received, before validation,
// so its strings are clipped.
func appendAuditLine(dst []byte, now time.Time, rec *auditRecord, req *pb.ExchangeRequest, code codes.Code, err error, latency time.Duration) []byte {
	dst = append(dst, `{"time":"`...)
	dst = now.AppendFormat(dst, time.RFC3339Nano)
	dst = append(dst, `","level":"INFO","msg":"exchange","logger":"audit","cluster":`...)
	dst = appendRef(dst, req.GetCluster())
	dst = append(dst, `,"requestedServiceAccount":`...)
	dst = appendRef(dst, req.GetServiceAccount())
	dst = append(dst, `,"audiences":`...)
	dst = appendStrings(dst, req.GetAudiences())
	dst = append(dst, `,"code":"`...)
	dst = append(dst, code.String()...)
	dst = append(dst, `","cacheHit":`...)
	dst = strconv.AppendBool(dst, rec.cacheHit)
	dst = append(dst, `,"latency":"`...)
	dst = append(dst, latency.String()...)
	dst = append(dst, '"')
	if u := &rec.user; rec.authenticated {
		dst = append(dst, `,"user":`...)
		dst = appendString(dst, u.Username)
		dst = append(dst, `,"uid":`...)
		dst = appendString(dst, u.UID)
	}
	if m := &rec.minted; rec.answered {
		// The token's checked claims, not what the agent said beside it.
		dst = append(dst, `,"serviceAccount":`...)
		dst = appendPair(dst, m.serviceAccount.Namespace, m.serviceAccount.Name)
		dst = append(dst, `,"tokenAudiences":`...)
		dst = appendStrings(dst, m.audiences)
		dst = append(dst, `,"expiration":"`...)
		dst = m.expiry.UTC().AppendFormat(dst, time.RFC3339)
		dst = append(dst, `","credentialID":`...)
		dst = appendString(dst, m.credentialID)
	}
	if err != nil {
		dst = append(dst, `,"reason":`...)
		dst = appendString(dst, err.Error())
	}
	return append(dst, "}\n"...)
}

// appendRef appends "namespace/name" of r, clipped and scanned, or "" for
// none.
func appendRef(dst []byte, r *pb.ObjectReference) []byte {
	if r == nil || len(r.GetNamespace())+1+len(r.GetName()) > maxClip {
		return appendString(dst, clip(refString(r)))
	}
	return appendPair(dst, r.GetNamespace(), r.GetName())
}

// appendPair appends "namespace/name", scanned. The slash is no token
// character, so scanning its sides apart is scanning the whole.
func appendPair(dst []byte, namespace, name string) []byte {
	dst = append(dst, '"')
	dst = token.AppendRedacted(dst, namespace, appendEscaped)
	dst = append(dst, '/')
	dst = token.AppendRedacted(dst, name, appendEscaped)
	return append(dst, '"')
}

// appendStrings appends the first maxAudiences of ss, each clipped and
// scanned, as a JSON array, escaped as encoding/json escapes (which the
// slog handler used for string lists).
func appendStrings(dst []byte, ss []string) []byte {
	dst = append(dst, '[')
	for i, s := range ss[:min(len(ss), maxAudiences)] {
		if i > 0 {
			dst = append(dst, ',')
		}
		dst = append(dst, '"')
		dst = token.AppendRedacted(dst, clip(s), appendEscapedInList)
		dst = append(dst, '"')
	}
	return append(dst, ']')
}

// appendString appends s, scanned, as a JSON string.
func appendString(dst []byte, s string) []byte {
	dst = append(dst, '"')
	dst = token.AppendRedacted(dst, s, appendEscaped)
	return append(dst, '"')
}

func appendEscaped(dst []byte, s string) []byte       { return appendJSONText(dst, s, false) }
func appendEscapedInList(dst []byte, s string) []byte { return appendJSONText(dst, s, true) }

// appendJSONText appends s escaped for the inside of a JSON string, as
// log/slog's JSON handler escapes a string value: \", \\, \n, \r, \t,
// \u00XX for the other control bytes, \ufffd for each byte that is not
// UTF-8, \u2028 and \u2029; HTML characters as they are. inList escapes
// \b and \f as \b and \f, as encoding/json does in the string lists that
// the handler marshalled.
func appendJSONText(dst []byte, s string, inList bool) []byte {
	const hex = "0123456789abcdef"
	start := 0
	for i := 0; i < len(s); {
		b := s[i]
		if b >= 0x20 && b != '"' && b != '\\' && b < utf8.RuneSelf {
			i++
			continue
		}
		c, size := rune(b), 1
		if b >= utf8.RuneSelf {
			if c, size = utf8.DecodeRuneInString(s[i:]); size > 1 && c != '\u2028' && c != '\u2029' {
				i += size
				continue
			}
		}
		dst = append(dst, s[start:i]...)
		switch {
		case b == '"' || b == '\\':
			dst = append(dst, '\\', b)
		case b == '\n':
			dst = append(dst, `\n`...)
		case b == '\r':
			dst = append(dst, `\r`...)
		case b == '\t':
			dst = append(dst, `\t`...)
		case inList && b == '\b':
			dst = append(dst, `\b`...)
		case inList && b == '\f':
			dst = append(dst, `\f`...)
		case b < 0x20:
			dst = append(dst, '\\', 'u', '0', '0', hex[b>>4], hex[b&0xF])
		case size == 1: // not UTF-8
			dst = append(dst, `\ufffd`...)
		default: // U+2028, U+2029
			dst = append(dst, '\\', 'u', '2', '0', '2', hex[c&0xF])
		}
		i += size
		start = i
	}
	return append(dst, s[start:]...)
}
