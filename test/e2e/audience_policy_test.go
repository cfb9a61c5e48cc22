package e2e

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// A consumer allowed on a spoke ServiceAccount gets a token for a cloud's
// audience (here AWS STS, as IRSA trusts) only when the spoke admin lists
// that audience on the ServiceAccount: such a token is a cloud credential.
func TestAudiencePolicy(t *testing.T) {
	ctx := context.Background()
	const sts = "sts.amazonaws.com"
	spoke := env.Spokes[1]
	c := newConsumer(t, "credbroker", spoke.Name)
	plain := optIn(t, spoke, "plain", c.username())
	irsa := optInAudiences(t, spoke, "irsa", []string{sts}, c.username())

	t.Run("not listed", func(t *testing.T) {
		_, err := exchange(t, c, &pb.ExchangeRequest{
			Cluster:        clusterRef(spoke),
			ServiceAccount: &pb.ObjectReference{Namespace: plain, Name: "plain"},
			Audiences:      []string{sts},
		})
		st := status.Convert(err)
		assert.Equal(t, codes.PermissionDenied, st.Code(), st.Message())
		assert.Contains(t, st.Message(), "credbroker.io/allowed-audiences")
		assert.Contains(t, st.Message(), sts)
	})

	t.Run("listed", func(t *testing.T) {
		resp, err := exchange(t, c, &pb.ExchangeRequest{
			Cluster:        clusterRef(spoke),
			ServiceAccount: &pb.ObjectReference{Namespace: irsa, Name: "irsa"},
			Audiences:      []string{sts},
		})
		require.NoError(t, err)
		assert.Equal(t, []string{sts}, claims(t, resp.GetToken()).Aud)
		review, err := spoke.ReviewToken(ctx, resp.GetToken(), []string{sts})
		require.NoError(t, err)
		require.True(t, review.Authenticated, review.Error)
		assert.Equal(t, []string{sts}, review.Audiences)
		assert.Equal(t, "system:serviceaccount:"+irsa+":irsa", review.User.Username)
	})

	t.Run("no audiences is the spoke's default, without the annotation", func(t *testing.T) {
		resp, err := exchange(t, c, &pb.ExchangeRequest{
			Cluster:        clusterRef(spoke),
			ServiceAccount: &pb.ObjectReference{Namespace: plain, Name: "plain"},
		})
		require.NoError(t, err)
		review, err := spoke.ReviewToken(ctx, resp.GetToken(), nil)
		require.NoError(t, err)
		require.True(t, review.Authenticated, review.Error)
	})
}
