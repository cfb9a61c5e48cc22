package tokenexchange

import (
	"crypto/sha256"
	"encoding/binary"
	"slices"
	"sync"

	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/hubauth"
)

// keyBuffers holds the buffers that cache keys are built in: the cached
// path builds three keys per exchange.
var keyBuffers = sync.Pool{New: func() any { b := make([]byte, 0, 512); return &b }}

// keyBuilder builds a cache key from lists of strings without reflection:
// each string is written after its length, and each list after its count,
// so that no two different lists give the same bytes; the key is their
// SHA-256.
type keyBuilder struct {
	buf *[]byte
}

func newKey() keyBuilder {
	b := keyBuffers.Get().(*[]byte)
	*b = (*b)[:0]
	return keyBuilder{buf: b}
}

func (k keyBuilder) count(n int) {
	*k.buf = binary.AppendUvarint(*k.buf, uint64(n))
}

func (k keyBuilder) add(values ...string) {
	for _, v := range values {
		k.count(len(v))
		*k.buf = append(*k.buf, v...)
	}
}

func (k keyBuilder) list(values []string) {
	k.count(len(values))
	k.add(values...)
}

// cacheKey is the key of the exchange's caches: a SHA-256 (keyBuilder)
// or an HMAC-SHA-256 (Service.bearerKey), which cost no allocation.
type cacheKey = [sha256.Size]byte

// sum returns the key and gives the buffer back.
func (k keyBuilder) sum() cacheKey {
	sum := sha256.Sum256(*k.buf)
	k.release()
	return sum
}

// release gives the buffer back to keyBuffers.
func (k keyBuilder) release() {
	if cap(*k.buf) <= 64<<10 {
		keyBuffers.Put(k.buf)
	}
}

// userKey adds every field of a hub user that a decision may depend on.
func (k keyBuilder) user(u hubauth.User) {
	k.add(u.UID, u.Username)
	k.list(u.Groups)
	k.count(len(u.Extra))
	// The extra's names, sorted, in an array on the stack: TokenReviews
	// name a few (the credential id, the pod's name and UID, the node's).
	var stack [8]string
	names := stack[:0]
	for name := range u.Extra {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		k.add(name)
		k.list(u.Extra[name])
	}
}

// tokenKey identifies the minted tokens that one request may reuse: the same
// ClusterProfile incarnation, consumer, spoke ServiceAccount and audiences.
func tokenKey(cluster fleet.ClusterRef, user hubauth.User, r request) cacheKey {
	k := newKey()
	k.add(string(cluster.UID), cluster.Namespace, cluster.Name, user.UID, user.Username, r.serviceAccount.Namespace, r.serviceAccount.Name)
	k.list(r.audiences)
	return k.sum()
}
