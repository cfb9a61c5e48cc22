package e2e

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// maxColdCalls bounds BenchmarkExchange's iterations: each cold exchange
// asks for an audience of its own, which the spoke ServiceAccount lists.
const maxColdCalls = 1000

// BenchmarkExchange measures, in one loop and so under the same conditions:
//
//   - direct: a TokenRequest straight to the spoke API server, the baseline;
//   - cold: an exchange whose token is not cached (a new audience each time),
//     so it makes a round trip through the broker, the agent and TokenRequest
//     (the hub's TokenReview and SubjectAccessReview decisions are cached);
//   - cached: an exchange served from the broker's token cache.
//
// It reports each as ns per call, and cold and cached as ratios of direct.
// It runs at most maxColdCalls iterations (make bench runs 200).
func BenchmarkExchange(b *testing.B) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	c := newConsumer(b, "credbroker", spoke.Name)
	// A cold exchange needs a new audience each time, and each must be
	// allowed on the spoke ServiceAccount.
	coldAudiences := make([]string, maxColdCalls)
	for i := range coldAudiences {
		coldAudiences[i] = fmt.Sprintf("bench-cold-%d", i)
	}
	ns := optInAudiences(b, spoke, "bench-sa", append(coldAudiences, "bench-cached"), c.username())
	client := exchangeClient(b)
	call := bearer(c.token)
	cachedReq := &pb.ExchangeRequest{Cluster: clusterRef(spoke), Audiences: []string{"bench-cached"}}
	_, err := client.Exchange(call, cachedReq)
	require.NoError(b, err)

	var direct, cold, cached time.Duration
	for i := 0; b.Loop(); i++ {
		if i == maxColdCalls {
			b.Fatalf("more than %d iterations; run with -benchtime %dx or less", maxColdCalls, maxColdCalls)
		}
		start := time.Now()
		_, err := spoke.Token(ctx, ns, "bench-sa", []string{fmt.Sprintf("bench-direct-%d", i)}, time.Hour)
		direct += time.Since(start)
		require.NoError(b, err)

		start = time.Now()
		_, err = client.Exchange(call, &pb.ExchangeRequest{Cluster: clusterRef(spoke), Audiences: []string{coldAudiences[i]}})
		cold += time.Since(start)
		require.NoError(b, err)

		start = time.Now()
		_, err = client.Exchange(call, cachedReq)
		cached += time.Since(start)
		require.NoError(b, err)
	}
	n := float64(b.N)
	b.ReportMetric(float64(direct.Nanoseconds())/n, "direct-ns/call")
	b.ReportMetric(float64(cold.Nanoseconds())/n, "cold-ns/call")
	b.ReportMetric(float64(cached.Nanoseconds())/n, "cached-ns/call")
	b.ReportMetric(float64(cold)/float64(direct), "cold/direct")
	b.ReportMetric(float64(cached)/float64(direct), "cached/direct")
}
