package tokenexchange

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/metadata"
	"k8s.io/apimachinery/pkg/util/validation"

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
// refusal must be InvalidArgument or Unauthenticated. A parsed request never
// carries the broker's audience, its audiences are a sorted set of valid
// audiences, and its expiration is within bounds. An accepted bearer token
// has three segments and is at most 16 KiB. Seeds: f.Add below and
// testdata/fuzz/FuzzParseRequest.
func FuzzParseRequest(f *testing.F) {
	f.Add("fleet", "a", "spoke", "reader", "aud", int64(600), "Bearer e30.e30.")
	f.Add("", "", "", "", "", int64(-1), "")
	f.Add("Fleet", strings.Repeat("a", 300), "x", "y/z", "\x00", int64(1<<62), "bearer a.b.c")
	f.Fuzz(func(t *testing.T, ns, name, saNS, saName, aud string, secs int64, header string) {
		req := &pb.ExchangeRequest{
			Cluster:           &pb.ObjectReference{Namespace: ns, Name: name},
			Audiences:         strings.Split(aud, ","),
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
		} else {
			if r.expiration < 10*time.Minute || r.expiration > time.Hour {
				t.Fatalf("expiration %s out of bounds", r.expiration)
			}
			if slices.Contains(r.audiences, "credbroker") {
				t.Fatalf("a parsed request carries the broker's audience: %q", r.audiences)
			}
			if !slices.IsSorted(r.audiences) || len(slices.Compact(slices.Clone(r.audiences))) != len(r.audiences) {
				t.Fatalf("audiences %q are not a sorted set", r.audiences)
			}
			for _, a := range r.audiences {
				if !validAudience(a) || !slices.Contains(req.GetAudiences(), a) {
					t.Fatalf("audience %q was not asked for, or is not valid", a)
				}
			}
			if r.cluster.Namespace != ns || r.cluster.Name != name {
				t.Fatalf("cluster %v is not the one asked for", r.cluster)
			}
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
		} else {
			if parts := strings.Split(tok, "."); len(parts) != 3 {
				t.Fatalf("accepted a bearer token of %d segments", len(parts))
			}
			if len(tok) > 16<<10 {
				t.Fatalf("accepted a bearer token of %d bytes", len(tok))
			}
			if !strings.HasSuffix(header, tok) {
				t.Fatal("the accepted token is not the header's")
			}
		}
	})
}

// isLabel lets a name skip apimachinery's validation: it must never
// accept what that validation refuses, as a DNS label or as a subdomain.
func FuzzIsLabel(f *testing.F) {
	for _, s := range []string{"", "a", "apps", "fleet-1", "-a", "a-", "A", "a.b", "a_b", strings.Repeat("a", 63), strings.Repeat("a", 64), "é", "a\x00"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if !isLabel(s) {
			return
		}
		assert.Empty(t, validation.IsDNS1123Label(s), "isLabel accepted %q, which is no DNS label", s)
		assert.Empty(t, validation.IsDNS1123Subdomain(s), "isLabel accepted %q, which is no DNS subdomain", s)
	})
}

func TestIsLabel(t *testing.T) {
	for s, want := range map[string]bool{
		"apps": true, "fleet-1": true, "0": true, strings.Repeat("a", 63): true,
		"": false, "-a": false, "a-": false, "A": false, "a.b": false, strings.Repeat("a", 64): false,
	} {
		assert.Equal(t, want, isLabel(s), "%q", s)
	}
}
