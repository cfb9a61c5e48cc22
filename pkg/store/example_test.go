package store_test

import (
	"context"
	"fmt"
	"time"

	"github.com/credbroker/credbroker/pkg/store"
)

type token struct {
	value           string
	issued, expires time.Time
}

func ExampleCache_Do() {
	cache, err := store.New[string, token](store.Config{Size: 1000, MaxTTL: time.Hour})
	if err != nil {
		panic(err)
	}

	mint := func(ctx context.Context) (token, time.Time, error) {
		// fetch runs without the caller's cancellation: bound it.
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		_ = ctx // pass ctx to the real call
		fmt.Println("minting")
		now := time.Now()
		tok := token{value: "t-1", issued: now, expires: now.Add(10 * time.Minute)}
		// Reuse the token only while at least half its lifetime remains.
		return tok, store.Halfway(tok.issued, tok.expires), nil
	}

	// The key is an HMAC of whatever identifies the request, never a secret.
	key := "token:3f1a9c"
	for range 2 {
		tok, hit, err := cache.Do(context.Background(), key, mint)
		if err != nil {
			panic(err)
		}
		fmt.Println(tok.value, "hit:", hit)
	}
	// Output:
	// minting
	// t-1 hit: false
	// t-1 hit: true
}
