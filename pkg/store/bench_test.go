package store

import (
	"context"
	"strconv"
	"testing"
	"time"
)

// The cache's hot paths, for benchstat (make bench-go).

// BenchmarkDoHit is a lookup that hits, from every GOMAXPROCS goroutine at
// once over 1,000 keys: the broker's cached exchanges do three (authn,
// authz, token) and a rate-limit lookup on each miss.
func BenchmarkDoHit(b *testing.B) {
	c, err := New[string, int](Config{Size: 10000, MaxTTL: time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	keys := make([]string, 1000)
	for i := range keys {
		keys[i] = strconv.Itoa(i)
		c.Add(keys[i], i, time.Now().Add(time.Hour))
	}
	fetch := func(context.Context) (int, time.Time, error) { b.Fatal("missed"); return 0, time.Time{}, nil }
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			if _, _, err := c.Do(context.Background(), keys[i%len(keys)], fetch); err != nil {
				b.Error(err)
				return
			}
			i++
		}
	})
}

// BenchmarkDoMiss is a lookup that misses and stores a new entry.
func BenchmarkDoMiss(b *testing.B) {
	c, err := New[string, int](Config{Size: 10000, MaxTTL: time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	fetch := func(context.Context) (int, time.Time, error) { return 1, time.Now().Add(time.Hour), nil }
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		if _, _, err := c.Do(context.Background(), strconv.Itoa(i), fetch); err != nil {
			b.Fatal(err)
		}
		i++
	}
}
