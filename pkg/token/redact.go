package token

import "strings"

// Redact returns s with everything that may be a token, or part of one,
// replaced by "[redacted sha256:…]", the Fingerprint of what it replaced: a
// run of base64url characters and dots (a JWT, or some of its segments) is
// replaced whole when one of its dot-separated parts starts like a JSON
// segment ("eyJ", the base64url of `{"`) and is at least 16 characters, or
// is at least 64 characters long (an RS, PS or ES signature is 86 or more).
// Names, DNS names, SPIFFE IDs, UIDs and JTI credential ids are left alone.
// Writers of audit and log lines use it on text a caller or an agent chose.
func Redact(s string) string {
	i, j := nextToken(s, 0)
	if i < 0 {
		return s
	}
	var b strings.Builder
	b.Grow(len(s))
	last := 0
	for ; i >= 0; i, j = nextToken(s, j) {
		b.WriteString(s[last:i])
		b.WriteString("[redacted " + Fingerprint(s[i:j]) + "]")
		last = j
	}
	b.WriteString(s[last:])
	return b.String()
}

// AppendRedacted appends s to dst as Redact would return it, without
// building that string: the text between the token-like runs goes through
// appendText (a JSON string escaper, say), and each run is replaced by
// "[redacted sha256:…]", appended as is (it holds nothing to escape).
func AppendRedacted(dst []byte, s string, appendText func(dst []byte, text string) []byte) []byte {
	last := 0
	for i, j := nextToken(s, 0); i >= 0; i, j = nextToken(s, j) {
		dst = appendText(dst, s[last:i])
		dst = append(appendFingerprint(append(dst, "[redacted "...), s[i:j]), ']')
		last = j
	}
	return appendText(dst, s[last:])
}

// nextToken returns the bounds of the first token-like run of s that
// starts at or after from, or -1, -1.
func nextToken(s string, from int) (start, end int) {
	for i := from; i < len(s); {
		if !isRunByte(s[i]) {
			i++
			continue
		}
		j := i
		for j < len(s) && isRunByte(s[j]) {
			j++
		}
		if tokenLike(s[i:j]) {
			return i, j
		}
		i = j
	}
	return -1, -1
}

func isRunByte(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.'
}

func tokenLike(run string) bool {
	for part := range strings.SplitSeq(run, ".") {
		if len(part) >= 64 || len(part) >= 16 && strings.HasPrefix(part, "eyJ") {
			return true
		}
	}
	return false
}
