package framework

import (
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestTestGoroutinesNamesTheRunningTest(t *testing.T) {
	// A server's accept loop is a goroutine outside test code.
	srv := httptest.NewServer(nil)
	defer srv.Close()
	stacks := string(TestGoroutines())
	assert.Contains(t, stacks, "TestTestGoroutinesNamesTheRunningTest")
	assert.NotContains(t, stacks, "net/http.(*Server).Serve", "a goroutine with no frame in test code")
}
