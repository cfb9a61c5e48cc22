// Package store is a bounded, in-memory cache in which every entry carries
// its own freshness time, with singleflight on misses. credbroker uses it for
// short-lived tokens and for authentication and authorization decisions, but
// the package is generic: it imports neither gRPC nor Kubernetes.
//
// Create one Cache per kind of value, once, at start-up:
//
//	cache, err := store.New[string, Decision](store.Config{Size: 10000, MaxTTL: 10 * time.Minute, Clock: clk})
//
// Each entry is fresh until the time given when it was stored, judged by
// Config.Clock (any k8s.io/utils/clock clock satisfies Clock). Get returns an
// entry only while Clock.Now() is before that time; a stale entry is removed
// and reported missing. Independently, no entry stays in memory longer than
// Config.MaxTTL after it was last stored, and the least recently used entry
// is evicted once there are more than Config.Size. MaxTTL is measured by the
// real clock (it is the TTL of the underlying
// github.com/hashicorp/golang-lru/v2/expirable LRU), so it is a memory bound,
// not a freshness rule, and is not moved by a fake Clock in tests.
//
// Do is the usual way in: it returns the fresh cached value, or calls fetch
// once for all concurrent callers of the same key, stores the result until
// the freshUntil that fetch returns, and hands it to every waiter:
//
//	v, hit, err := cache.Do(ctx, key, func(ctx context.Context) (Token, time.Time, error) {
//		ctx, cancel := context.WithTimeout(ctx, 5*time.Second) // fetch must bound itself
//		defer cancel()
//		tok, err := mint(ctx)
//		if err != nil {
//			return Token{}, time.Time{}, err
//		}
//		return tok, store.Halfway(tok.IssuedAt, tok.ExpiresAt), nil
//	})
//
// fetch runs under context.WithoutCancel of the first caller's ctx: it keeps
// that ctx's values but not its deadline or cancellation, so one caller
// giving up does not fail the others, and fetch must set its own timeout.
// Each caller waits with its own ctx. Errors are never cached. A panic in
// fetch is recovered and returned to every waiter as an error wrapping
// ErrFetchPanicked; the panic value is not kept, since it may hold secrets.
// All callers sharing a fetch receive the same V, so a V holding pointers,
// slices or maps must be treated as read-only.
//
// Keys are plain strings and are kept in memory and compared as they are.
// Never use a secret (a bearer token, a client secret) as a key: hash it
// first with a keyed hash such as HMAC-SHA-256 under a per-process random
// key, and use the digest. Build keys that cannot collide across meanings,
// for example by prefixing the kind of entry.
//
// Halfway gives the freshUntil for a token: it is reused only while at least
// half of its lifetime remains.
//
// Each Cache starts one background goroutine (the expirable LRU's cleaner)
// that never exits, so do not create caches per request.
package store
