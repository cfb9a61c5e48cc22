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
	var b strings.Builder
	last, changed := 0, false
	for i := 0; i < len(s); {
		if !isRunByte(s[i]) {
			i++
			continue
		}
		j := i
		for j < len(s) && isRunByte(s[j]) {
			j++
		}
		if run := s[i:j]; tokenLike(run) {
			if !changed {
				b.Grow(len(s))
				changed = true
			}
			b.WriteString(s[last:i])
			b.WriteString("[redacted " + Fingerprint(run) + "]")
			last = j
		}
		i = j
	}
	if !changed {
		return s
	}
	b.WriteString(s[last:])
	return b.String()
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
