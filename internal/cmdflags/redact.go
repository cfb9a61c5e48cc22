package cmdflags

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"

	"github.com/credbroker/credbroker/pkg/token"
)

// redactHandler passes every message and value through token.Redact before
// next writes it: whatever a caller or an agent put in a field that is
// echoed back (an audience, a name, a refusal's reason), no token, and no
// segment of one, reaches the audit log.
//
// Two kinds of value skip the scan, for the cost of the audit line on every
// exchange: values of a kind other than string and any (numbers, booleans,
// durations, times), which cannot hold a token, and strings under a key of
// serviceFormatted. Every other key is scanned, so a new field is redacted
// unless someone adds its key to that list.
type redactHandler struct{ next slog.Handler }

// serviceFormatted are the audit keys whose string values the services
// format themselves from values no caller or agent chooses: a gRPC code's
// name, a time.Duration's String, an RFC 3339 time, a method's name. Never
// add a key that may carry a request's or an agent's string (names,
// audiences, credential ids built from a jti, reasons): the test
// TestAuditLoggerSkipsOnlyServiceFormattedKeys lists the keys that must stay
// scanned.
var serviceFormatted = map[string]bool{
	"code":       true, // errdefs.Code(err).String()
	"latency":    true, // time.Duration.String()
	"expiration": true, // RFC 3339 of a checked exp claim
	"method":     true, // the Grants method's name
}

func (h redactHandler) Enabled(ctx context.Context, l slog.Level) bool { return h.next.Enabled(ctx, l) }

func (h redactHandler) Handle(ctx context.Context, r slog.Record) error {
	out := slog.NewRecord(r.Time, r.Level, token.Redact(r.Message), r.PC)
	// Added at once: one by one, the record's slice grows several times.
	attrs := make([]slog.Attr, 0, r.NumAttrs())
	r.Attrs(func(a slog.Attr) bool {
		attrs = append(attrs, redactAttr(a, true))
		return true
	})
	out.AddAttrs(attrs...)
	return h.next.Handle(ctx, out)
}

func (h redactHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	out := make([]slog.Attr, len(attrs))
	for i, a := range attrs {
		out[i] = redactAttr(a, true)
	}
	return redactHandler{h.next.WithAttrs(out)}
}

func (h redactHandler) WithGroup(name string) slog.Handler {
	return redactHandler{h.next.WithGroup(name)}
}

// redactAttr redacts a; top is false inside a group, where every string is
// scanned whatever its key.
func redactAttr(a slog.Attr, top bool) slog.Attr {
	v := a.Value.Resolve()
	switch v.Kind() {
	case slog.KindString:
		if top && serviceFormatted[a.Key] {
			return slog.Attr{Key: a.Key, Value: v}
		}
		return slog.String(a.Key, token.Redact(v.String()))
	case slog.KindGroup:
		group := v.Group()
		out := make([]slog.Attr, len(group))
		for i, g := range group {
			out[i] = redactAttr(g, false)
		}
		return slog.Attr{Key: a.Key, Value: slog.GroupValue(out...)}
	case slog.KindAny:
		switch x := v.Any().(type) {
		case []string:
			out := make([]string, len(x))
			for i, s := range x {
				out[i] = token.Redact(s)
			}
			return slog.Any(a.Key, out)
		case error:
			return slog.String(a.Key, token.Redact(x.Error()))
		case fmt.Stringer:
			return slog.String(a.Key, token.Redact(x.String()))
		default:
			// Anything else as the JSON handler would write it, redacted
			// if need be.
			b, err := json.Marshal(x)
			if err != nil {
				return slog.String(a.Key, token.Redact(fmt.Sprint(x)))
			}
			if s := string(b); token.Redact(s) != s {
				return slog.String(a.Key, token.Redact(s))
			}
		}
	}
	return slog.Attr{Key: a.Key, Value: v}
}
