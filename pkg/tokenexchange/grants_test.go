package tokenexchange

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/credbroker/credbroker/pkg/fleet"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// fakeGrants stands in for the broker's grant registry.
type fakeGrants struct {
	mu      sync.Mutex
	revoked map[string]bool
	updates []*pb.GrantUpdate
	cluster []fleet.ClusterRef
}

func (g *fakeGrants) Revoked(id string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.revoked[id]
}

func (g *fakeGrants) Update(_ context.Context, cluster fleet.ClusterRef, u *pb.GrantUpdate) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.updates = append(g.updates, u)
	g.cluster = append(g.cluster, cluster)
}

func (g *fakeGrants) revoke(id string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.revoked == nil {
		g.revoked = map[string]bool{}
	}
	g.revoked[id] = true
}

func withGrants(g *fakeGrants) func(*Config) { return func(c *Config) { c.Grants = g } }

// The attack: a token is revoked (its grant deleted on the spoke), and the
// consumer, or anyone with its hub token, asks again within the token
// cache's freshness. The broker must not hand out the revoked token.
func TestRevokedTokenIsNotServedFromCache(t *testing.T) {
	g := &fakeGrants{}
	f := newFixture(t, withGrants(g))
	first, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
	require.NoError(t, err)
	again, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
	require.NoError(t, err)
	require.Equal(t, first.GetToken(), again.GetToken(), "an unrevoked token is served from the cache")

	g.revoke(first.GetCredentialId())
	fresh, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
	require.NoError(t, err)
	assert.NotEqual(t, first.GetToken(), fresh.GetToken(), "the broker served a revoked token from its cache")
	assert.NotEqual(t, first.GetCredentialId(), fresh.GetCredentialId())
	assert.Equal(t, int32(2), f.minter.calls.Load())

	// The new token is cached in place of the revoked one.
	last, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
	require.NoError(t, err)
	assert.Equal(t, fresh.GetToken(), last.GetToken())
}

// The attack: a compromised agent answers with a token the broker knows is
// revoked. The broker must not hand it out.
func TestRevokedTokenFromAgentIsRefused(t *testing.T) {
	g := &fakeGrants{}
	f := newFixture(t, withGrants(g))
	g.revoke("JTI=minted-1")
	g.revoke("JTI=minted-2")
	g.revoke("JTI=minted-3")
	_, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
	require.Error(t, err)
	assert.Equal(t, codes.Unavailable, status.Code(err))
	assert.Contains(t, err.Error(), "revoked")
}

func TestMintedTokenIsRecordedAsGrant(t *testing.T) {
	g := &fakeGrants{}
	f := newFixture(t, withGrants(g))
	req := &pb.ExchangeRequest{Cluster: fleetA().Cluster, Audiences: []string{"x", "y"}, ExpirationSeconds: 1200}
	resp, err := f.svc.Exchange(withBearer(consumerToken), req)
	require.NoError(t, err)
	_, err = f.svc.Exchange(withBearer(consumerToken), req) // a cache hit adds nothing
	require.NoError(t, err)

	g.mu.Lock()
	defer g.mu.Unlock()
	require.Len(t, g.updates, 1)
	assert.Equal(t, "fleet/a", g.cluster[0].String())
	assert.Equal(t, "uid-1", string(g.cluster[0].UID))
	want := &pb.GrantUpdate{Added: []*pb.Grant{{
		CredentialId:   resp.GetCredentialId(),
		Cluster:        &pb.ObjectReference{Namespace: "fleet", Name: "a"},
		ClusterUid:     "uid-1",
		Subject:        &pb.Subject{Username: "system:serviceaccount:hub:consumer", Uid: "consumer-uid", Groups: []string{"system:serviceaccounts"}},
		ServiceAccount: &pb.ObjectReference{Namespace: "spoke", Name: "reader"},
		Audiences:      []string{"x", "y"},
		ExpirationTime: timestamppb.New(t0.Add(1200 * time.Second)),
		// The API proxy forwards the token only if it hashes to this.
		TokenSha256: tokenSHA256(resp.GetToken()),
	}}}
	assert.True(t, proto.Equal(want, g.updates[0]), "got %v", g.updates[0])
}
