package tokenexchange

import (
	"testing"

	"github.com/stretchr/testify/assert"
	authenticationv1 "k8s.io/api/authentication/v1"

	"github.com/credbroker/credbroker/pkg/hubauth"
)

// Cache keys are injective for one cache's fields: what differs in any
// field, or in where one field or list ends and the next begins, gives
// another key; the same user gives the same key whatever the order of its
// extra map.
func TestKeysDoNotCollide(t *testing.T) {
	key := func(build func(k keyBuilder)) cacheKey {
		k := newKey()
		build(k)
		return k.sum()
	}
	user := func(u hubauth.User) func(keyBuilder) { return func(k keyBuilder) { k.user(u); k.add("fleet", "a") } }
	for schema, keys := range map[string]map[string]cacheKey{
		"two strings": {
			"ab|c": key(func(k keyBuilder) { k.add("ab", "c") }),
			"a|bc": key(func(k keyBuilder) { k.add("a", "bc") }),
			"|abc": key(func(k keyBuilder) { k.add("", "abc") }),
		},
		"two lists": {
			"[a][b]":  key(func(k keyBuilder) { k.list([]string{"a"}); k.list([]string{"b"}) }),
			"[a b][]": key(func(k keyBuilder) { k.list([]string{"a", "b"}); k.list(nil) }),
			"[][a b]": key(func(k keyBuilder) { k.list(nil); k.list([]string{"a", "b"}) }),
			"[ab][]":  key(func(k keyBuilder) { k.list([]string{"ab"}); k.list(nil) }),
		},
		"a user and a ClusterProfile": {
			"group x":     key(user(hubauth.User{Username: "u", Groups: []string{"x"}})),
			"extra x":     key(user(hubauth.User{Username: "u", Extra: map[string]authenticationv1.ExtraValue{"x": nil}})),
			"extra x=[y]": key(user(hubauth.User{Username: "u", Extra: map[string]authenticationv1.ExtraValue{"x": {"y"}}})),
			"uid u":       key(user(hubauth.User{UID: "u"})),
			"nothing":     key(user(hubauth.User{Username: "u"})),
		},
	} {
		seen := map[cacheKey]string{}
		for name, k := range keys {
			if other, ok := seen[k]; ok {
				t.Errorf("%s: %s and %s share a key", schema, name, other)
			}
			seen[k] = name
		}
	}

	extra := map[string]authenticationv1.ExtraValue{"a": {"1"}, "b": {"2"}, "c": {"3"}, "d": {"4"}}
	first := key(func(k keyBuilder) { k.user(hubauth.User{Username: "u", Extra: extra}) })
	for range 20 {
		assert.Equal(t, first, key(func(k keyBuilder) { k.user(hubauth.User{Username: "u", Extra: extra}) }), "map order does not change the key")
	}
}
