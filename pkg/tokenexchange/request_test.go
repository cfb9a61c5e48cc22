package tokenexchange

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/metadata"

	"github.com/credbroker/credbroker/pkg/errdefs"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

func TestParseRequestExpiration(t *testing.T) {
	tests := []struct {
		secs int64
		want time.Duration
	}{
		{secs: 0, want: time.Hour},
		{secs: 1, want: 10 * time.Minute},
		{secs: 900, want: 15 * time.Minute},
		{secs: 3600, want: time.Hour},
		{secs: 1 << 62, want: time.Hour},
	}
	for _, tt := range tests {
		r, err := parseRequest(&pb.ExchangeRequest{Cluster: fleetA().Cluster, ExpirationSeconds: tt.secs}, "credbroker", 10*time.Minute, time.Hour)
		require.NoError(t, err)
		assert.Equal(t, tt.want, r.expiration, "expiration_seconds %d", tt.secs)
	}
}

func TestParseRequestAudiences(t *testing.T) {
	r, err := parseRequest(&pb.ExchangeRequest{Cluster: fleetA().Cluster, Audiences: []string{"b", "a", "b"}}, "credbroker", 10*time.Minute, time.Hour)
	require.NoError(t, err)
	assert.Equal(t, []string{"a", "b"}, r.audiences)

	_, err = parseRequest(&pb.ExchangeRequest{Cluster: fleetA().Cluster, Audiences: make([]string, 17)}, "credbroker", 10*time.Minute, time.Hour)
	assert.EqualError(t, err, "audiences: 17 given, at most 16 allowed: invalid argument")

	_, err = parseRequest(&pb.ExchangeRequest{Cluster: fleetA().Cluster, Audiences: []string{"a\nb"}}, "credbroker", 10*time.Minute, time.Hour)
	assert.EqualError(t, err, "audiences[0]: want 1 to 256 printable characters: invalid argument")

	_, err = parseRequest(&pb.ExchangeRequest{Cluster: fleetA().Cluster, Audiences: []string{"x", "credbroker"}}, "credbroker", 10*time.Minute, time.Hour)
	assert.EqualError(t, err, `audiences[1]: "credbroker" is the broker's own audience and never goes into a spoke token: invalid argument`)
}

// FuzzParseRequest feeds arbitrary requests and bearer headers to the
// parsers that run before any API call: they must never panic, and every
// refusal must be InvalidArgument or Unauthenticated.
func FuzzParseRequest(f *testing.F) {
	f.Add("fleet", "a", "spoke", "reader", "aud", int64(600), "Bearer e30.e30.")
	f.Add("", "", "", "", "", int64(-1), "")
	f.Add("Fleet", strings.Repeat("a", 300), "x", "y/z", "\x00", int64(1<<62), "bearer a.b.c")
	f.Fuzz(func(t *testing.T, ns, name, saNS, saName, aud string, secs int64, header string) {
		req := &pb.ExchangeRequest{
			Cluster:           &pb.ObjectReference{Namespace: ns, Name: name},
			Audiences:         []string{aud},
			ExpirationSeconds: secs,
		}
		if saNS != "" || saName != "" {
			req.ServiceAccount = &pb.ObjectReference{Namespace: saNS, Name: saName}
		}
		r, err := parseRequest(req, "credbroker", 10*time.Minute, time.Hour)
		if err != nil {
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Fatalf("parseRequest: %v is not InvalidArgument", err)
			}
		} else if r.expiration < 10*time.Minute || r.expiration > time.Hour {
			t.Fatalf("expiration %s out of bounds", r.expiration)
		}

		ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs("authorization", header))
		tok, err := bearerToken(ctx)
		if err != nil {
			if !errors.Is(err, errdefs.ErrUnauthenticated) {
				t.Fatalf("bearerToken: %v is not Unauthenticated", err)
			}
			if len(tok) > 0 {
				t.Fatal("a token came back with an error")
			}
		}
	})
}
