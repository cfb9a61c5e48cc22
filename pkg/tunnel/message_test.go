package tunnel

import (
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"github.com/stretchr/testify/assert"
)

func TestAgentMessage(t *testing.T) {
	tests := []struct {
		name, msg, want string
	}{
		{name: "plain", msg: "spoke ServiceAccount x/y does not allow u", want: "spoke ServiceAccount x/y does not allow u"},
		{name: "empty", msg: "", want: ""},
		{name: "line breaks", msg: "no\n\nFAKE LOG LINE\r\nok", want: "no FAKE LOG LINE ok"},
		{name: "terminal escapes", msg: "\x1b[31mred\x1b[0m", want: "[31mred [0m"},
		{name: "nul and del", msg: "a\x00b\x7fc", want: "a b c"},
		{name: "c1 controls", msg: "a\u0085b\u009bc", want: "a b c"},
		{name: "bidi override and zero width", msg: "a\u202eb\u200bc", want: "a b c"},
		{name: "line and paragraph separators", msg: "a\u2028b\u2029c", want: "a b c"},
		{name: "leading and trailing controls", msg: "\n\t a \n", want: "a"},
		{name: "controls beside spaces", msg: "a \n b\r\n c \x1b[0m", want: "a b c [0m"},
		{name: "https url", msg: "sign in at https://login.evil.example/reset?u=x now", want: "sign in at [link removed] now"},
		{name: "url in quotes", msg: `Post "https://10.0.0.1:6443/api/v1": dial tcp`, want: `Post "[link removed] dial tcp`},
		{name: "other schemes", msg: "see hxxp://a and git+ssh://b and s3://c", want: "see [link removed] and [link removed] and [link removed]"},
		{name: "bare scheme separator", msg: "go to ://evil", want: "go to [link removed]"},
		{name: "url split by a control character", msg: "htt\x00ps://evil.example", want: "htt [link removed]"},
		{name: "url hidden by a line break", msg: "https:\n//evil.example", want: "https: //evil.example"},
		{name: "invalid utf-8", msg: "a\xffb", want: "a\uFFFDb"},
		{name: "unicode kept", msg: "ServiceAccount é/名前", want: "ServiceAccount é/名前"},
		{name: "clipped", msg: strings.Repeat("a", maxAgentMessage+1), want: strings.Repeat("a", maxAgentMessage) + "..."},
		{name: "exactly the limit", msg: strings.Repeat("a", maxAgentMessage), want: strings.Repeat("a", maxAgentMessage)},
		{name: "clipped on a rune boundary", msg: "a" + strings.Repeat("é", maxAgentMessage), want: "a" + strings.Repeat("é", (maxAgentMessage-1)/2) + "..."},
		// Only the first 4*maxAgentMessage bytes are read: a message of
		// exactly that many is read whole, one byte more is clipped.
		{name: "read whole", msg: "ok" + strings.Repeat("\n", 4*maxAgentMessage-2), want: "ok"},
		{name: "one byte past what is read", msg: "ok" + strings.Repeat("\n", 4*maxAgentMessage-1), want: "ok..."},
		{name: "huge", msg: strings.Repeat("\n", 1<<20) + "x", want: "..."},
		{name: "links cannot grow it past the clip", msg: strings.Repeat("a:// ", maxAgentMessage), want: strings.Repeat(urlRemoved+" ", maxAgentMessage/(len(urlRemoved)+1)) + "[lin..."},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := agentMessage(tt.msg)
			assert.Equal(t, tt.want, got)
			assertFitForConsumer(t, got)
		})
	}
}

// The e2e tests of the sanitised message are in test/e2e/rogue_agent_test.go.
func assertFitForConsumer(t *testing.T, got string) {
	t.Helper()
	if !utf8.ValidString(got) {
		t.Fatalf("%q is not UTF-8", got)
	}
	if strings.ContainsFunc(got, func(r rune) bool { return unicode.In(r, unicode.Cc, unicode.Cf, unicode.Zl, unicode.Zp) }) {
		t.Fatalf("%q holds a control character", got)
	}
	if strings.Contains(got, "://") {
		t.Fatalf("%q holds a link", got)
	}
	if len(got) > maxAgentMessage+len("...") {
		t.Fatalf("%d bytes is longer than the clip", len(got))
	}
}

func FuzzAgentMessage(f *testing.F) {
	f.Add("spoke ServiceAccount x/y does not allow u")
	f.Add("a\nb\x1b[31m\u202e https://evil.example/x")
	f.Add("ht\x00tp://x ://y ::// :/:/")
	f.Add(strings.Repeat("é", maxAgentMessage))
	f.Add("a\xffb\xc3")
	f.Fuzz(func(t *testing.T, msg string) {
		assertFitForConsumer(t, agentMessage(msg))
	})
}
