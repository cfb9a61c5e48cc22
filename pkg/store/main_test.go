package store_test

import (
	"testing"

	"go.uber.org/goleak"
)

// lruCleaner is the expirable LRU's cleaner goroutine. golang-lru v2.0.7
// gives no way to stop it (its done channel is unexported and there is no
// Close), so it outlives each Cache; the package doc tells callers to
// create caches once, not per request. Only that goroutine is ignored:
// any other goroutine left behind by the tests still fails them.
const lruCleaner = "github.com/hashicorp/golang-lru/v2/expirable.NewLRU[...].func1"

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction(lruCleaner))
}
