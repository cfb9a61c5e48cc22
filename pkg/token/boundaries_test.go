package token

import (
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Each limit holds exactly at its bound: on it is accepted, past it is
// refused.
func TestBoundsAreExact(t *testing.T) {
	// A token of exactly MaxLength bytes has the right shape; one more byte
	// does not.
	short := jwt(`{"sub":"a"}`)
	padded := short + strings.Repeat("A", MaxLength-len(short))
	require.Len(t, padded, MaxLength)
	require.NoError(t, CheckShape(padded))
	require.Error(t, CheckShape(padded+"A"))
	// A segment that is not base64url from its first byte on.
	require.Error(t, CheckShape("+"+short))

	// A jti of 128 visible characters, '~' included, names the token.
	jti := strings.Repeat("a", 127) + "~"
	assert.Equal(t, "JTI="+jti, ID(jwt(`{"jti":"`+jti+`"}`)))

	// exp up to the end of 9999.
	const maxUnix = 253402300799
	_, err := ParseClaims(jwt(`{"exp":` + strconv.Itoa(maxUnix) + `}`))
	require.NoError(t, err)
	_, err = ParseClaims(jwt(`{"exp":` + strconv.Itoa(maxUnix+1) + `}`))
	require.Error(t, err)

	// A part of 64 base64url characters is token-like, and so is one of
	// 16 that starts like a JSON header.
	assert.NotContains(t, Redact("x "+strings.Repeat("a", 64)+" y"), strings.Repeat("a", 64))
	assert.Contains(t, Redact("x "+strings.Repeat("a", 63)+" y"), strings.Repeat("a", 63))
	assert.NotContains(t, Redact("x eyJ"+strings.Repeat("a", 13)+" y"), "eyJ"+strings.Repeat("a", 13))
	assert.Contains(t, Redact("x eyJ"+strings.Repeat("a", 12)+" y"), "eyJ"+strings.Repeat("a", 12))
}
