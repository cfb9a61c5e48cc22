package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/credbroker/credbroker/pkg/broker"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// Attack: a pod floods the broker with forged JWT-shaped tokens from the
// same address as a real consumer, hoping that every one costs a hub
// TokenReview until the broker's review budget is spent and real consumers
// are refused once their cached review expires.
//
// Defence: the broker verifies each token's signature against the hub
// issuer's keys before any TokenReview, so forgeries cost no hub call and
// spend no review budget, global or per address.
func TestForgedTokenFloodLocksNoConsumerOut(t *testing.T) {
	const (
		attackers = 4
		attack    = 25 * time.Second // crosses two authentication-cache expiries (10s)
		every     = 250 * time.Millisecond
	)
	ctx := context.Background()
	spoke := env.Spokes[0]
	c := newConsumer(t, "credbroker", spoke.Name)
	optIn(t, spoke, "flood-sa", c.username())
	req := &pb.ExchangeRequest{Cluster: clusterRef(spoke)}
	hubKid := jwtHeader(t, c.token).Kid
	require.NotEmpty(t, hubKid, "hub tokens name their signing key")

	client := exchangeClient(t)
	_, err := exchangeVia(t, client, c, req)
	require.NoError(t, err)
	before := hubTokenReviews(t)

	attackCtx, stop := context.WithTimeout(ctx, attack)
	defer stop()
	var (
		wg       sync.WaitGroup
		forged   atomic.Int64
		codesMu  sync.Mutex
		gotCodes = map[codes.Code]int{}
	)
	for i := range attackers {
		// Its own connection, like another process in the same pod: the
		// broker sees the same peer address as the consumer's.
		attacker := exchangeClient(t)
		rng := rand.New(rand.NewPCG(uint64(i), uint64(time.Now().UnixNano())))
		wg.Go(func() {
			for attackCtx.Err() == nil {
				callCtx, cancel := bearerWithin(attackCtx, forgedToken(rng, hubKid))
				_, err := attacker.Exchange(callCtx, req)
				cancel()
				if attackCtx.Err() != nil {
					return // cut short by the end of the attack
				}
				forged.Add(1)
				codesMu.Lock()
				gotCodes[status.Code(err)]++
				codesMu.Unlock()
			}
		})
	}

	var calls int
	var failures []string
	var lastCall time.Duration // since the attack began
	start := time.Now()
	tick := time.NewTicker(every)
	defer tick.Stop()
	for done := false; !done; {
		select {
		case <-attackCtx.Done():
			done = true
		case <-tick.C:
			calls++
			lastCall = time.Since(start)
			if _, err := exchangeVia(t, client, c, req); err != nil {
				failures = append(failures, fmt.Sprintf("call %d: %s", calls, status.Convert(err).Message()))
			}
		}
	}
	wg.Wait()
	reviews := hubTokenReviews(t) - before
	t.Logf("%d forged tokens sent (%v); the consumer made %d calls; the hub made %v TokenReviews", forged.Load(), gotCodes, calls, reviews)

	assert.Empty(t, failures, "the real consumer was refused during the flood")
	// The ticker drops ticks when a call is slow; what matters is that the
	// calls went on past two expiries of the consumer's cached review.
	assert.GreaterOrEqual(t, calls, int(attack/every)/2)
	assert.Greater(t, lastCall, 2*broker.Default().AuthnTTL, "the consumer stopped calling before its cached review expired twice")
	assert.Greater(t, forged.Load(), int64(attack/every), "the attack sent fewer forged tokens than the consumer sent real ones")
	// Every forged token is refused as unauthenticated; on a loaded machine
	// a few flooders' calls may reach their own deadline first.
	assert.Greater(t, gotCodes[codes.Unauthenticated], int(forged.Load())*9/10, "forged tokens refused as unauthenticated")
	for code := range gotCodes {
		assert.Contains(t, []codes.Code{codes.Unauthenticated, codes.DeadlineExceeded}, code, "a forged token got %s", code)
	}
	assert.Less(t, reviews, 20.0, "forged tokens cost hub TokenReviews")
}

// forgedToken returns a JWT-shaped token with a plausible header (a real
// algorithm, and a random key id or the hub's own), claims that would pass
// every claim check, or random bytes, and a random signature.
func forgedToken(rng *rand.Rand, hubKid string) string {
	enc := base64.RawURLEncoding.EncodeToString
	randBytes := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.UintN(256))
		}
		return b
	}
	kid := enc(randBytes(32))
	if rng.IntN(3) == 0 {
		kid = hubKid
	}
	alg := []string{"RS256", "RS384", "PS256", "ES256"}[rng.IntN(4)]
	header, _ := json.Marshal(map[string]string{"alg": alg, "kid": kid, "typ": "JWT"})
	payload := randBytes(64 + rng.IntN(256))
	if rng.IntN(2) == 0 {
		now := time.Now().Unix()
		payload, _ = json.Marshal(map[string]any{
			"aud": []string{"credbroker"},
			"exp": now + 3600, "iat": now, "nbf": now,
			"iss": "https://hub.credbroker.test",
			"jti": enc(randBytes(16)),
			"sub": fmt.Sprintf("system:serviceaccount:ns-%d:sa-%d", rng.IntN(1000), rng.IntN(1000)),
		})
	}
	return enc(header) + "." + enc(payload) + "." + enc(randBytes(256))
}

func bearerWithin(ctx context.Context, token string) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token), cancel
}

// jwtHeader decodes a JWT's header; the hub signed it, the test only reads
// which key it names.
func jwtHeader(t *testing.T, tok string) (h struct {
	Alg string `json:"alg"`
	Kid string `json:"kid"`
}) {
	t.Helper()
	head, _, ok := strings.Cut(tok, ".")
	require.True(t, ok)
	raw, err := base64.RawURLEncoding.DecodeString(head)
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(raw, &h))
	return h
}

// hubTokenReviews sums the hub API server's own count of TokenReview
// requests, apiserver_request_total{resource="tokenreviews"}.
func hubTokenReviews(t *testing.T) float64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	raw, err := env.Hub.Client.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(ctx)
	require.NoError(t, err)
	var sum float64
	var series int
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "apiserver_request_total{") || !strings.Contains(line, `resource="tokenreviews"`) {
			continue
		}
		fields := strings.Fields(line)
		v, err := strconv.ParseFloat(fields[len(fields)-1], 64)
		require.NoError(t, err, line)
		sum += v
		series++
	}
	require.NoError(t, sc.Err())
	require.Positive(t, series, "the hub reports no TokenReview requests; has its metric changed?")
	return sum
}
