package tunnel

import (
	"regexp"
	"strings"
	"unicode"
	"unicode/utf8"

	"google.golang.org/grpc/status"
)

// maxAgentMessage bounds the reason an agent gives, in bytes, before the
// "..." that marks a clipped one.
const maxAgentMessage = 1024

// urlPattern matches anything shaped like scheme://..., up to the next
// space, and a bare ://... with no scheme before it.
var urlPattern = regexp.MustCompile(`[A-Za-z0-9+.\-]*://\S*`)

// urlRemoved replaces every link in an agent's message.
const urlRemoved = "[link removed]"

// agentMessage makes an agent's error message fit to show a consumer: the
// agent may be compromised, and its message ends up in the consumer's logs
// and terminals. Runs of control, format and line- or paragraph-separator
// characters (line breaks, escape sequences, NUL, bidi overrides) become one
// space, or none beside a space; bytes that are not UTF-8 become U+FFFD; anything like a URL
// (scheme://...) becomes "[link removed]", so a consumer is never sent
// somewhere by a spoke; and the result is clipped to maxAgentMessage bytes.
// The agent logs its full message itself.
func agentMessage(msg string) string {
	// Read no more than could survive the clip: every kept rune is at
	// least one byte of output.
	clipped := len(msg) > 4*maxAgentMessage
	if clipped {
		msg = msg[:4*maxAgentMessage]
	}
	msg = strings.ToValidUTF8(msg, string(utf8.RuneError))
	var b strings.Builder
	space := false
	for _, r := range msg {
		if unicode.In(r, unicode.Cc, unicode.Cf, unicode.Zl, unicode.Zp) {
			space = true
			continue
		}
		if space {
			space = false
			afterSpace := strings.HasSuffix(b.String(), " ")
			if r == ' ' && afterSpace {
				continue
			}
			if r != ' ' && !afterSpace {
				b.WriteByte(' ')
			}
		}
		b.WriteRune(r)
	}
	msg = urlPattern.ReplaceAllLiteralString(strings.TrimSpace(b.String()), urlRemoved)
	if len(msg) > maxAgentMessage {
		// msg is valid UTF-8, so msg[0] starts a rune and the loop ends.
		cut := maxAgentMessage
		for !utf8.RuneStart(msg[cut]) {
			cut--
		}
		msg, clipped = msg[:cut], true
	}
	if clipped {
		msg += "..."
	}
	return msg
}

// The longest agent version and correlation id the broker logs, in bytes,
// before the "..." that marks a clipped one: an agent chooses them, and
// the log is not its to fill.
const (
	maxAgentVersion        = 128
	maxLoggedCorrelationID = 64
)

// agentVersion is the version an agent's hello names, fit to log: as
// agentMessage makes it, and clipped to maxAgentVersion bytes.
func agentVersion(v string) string { return clipAgentString(v, maxAgentVersion) }

// clipAgentString makes s, which an agent sent, fit to log: as
// agentMessage makes it, and clipped to at most n bytes and "...".
func clipAgentString(s string, n int) string {
	s = agentMessage(s)
	if len(s) <= n {
		return s
	}
	// s is valid UTF-8, so s[0] starts a rune and the loop ends.
	cut := n
	for !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "..."
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	if st, ok := status.FromError(err); ok {
		return st.Code().String() + ": " + st.Message()
	}
	return err.Error()
}
