package tunnel

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/credbroker/credbroker/pkg/errdefs"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// voterStream opens a Connect stream as agent id that names itself
// instance, ending with ctx, and waits for its admission.
func (h *harness) voterStream(t *testing.T, ctx context.Context, id, instance string) grpc.BidiStreamingClient[pb.AgentFrame, pb.BrokerFrame] {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///bufnet",
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return h.lis.DialContext(ctx) }))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ctx = metadata.AppendToOutgoingContext(ctx, "test-agent-id", id, instanceHeader, instance)
	stream, err := pb.NewAgentTunnelClient(conn).Connect(ctx)
	require.NoError(t, err)
	require.NoError(t, stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_Hello{Hello: &pb.Hello{}}}))
	md, err := stream.Header()
	require.NoError(t, err)
	require.NotEmpty(t, md.Get(admittedHeader))
	return stream
}

// The attack: a holder of the cluster's agent SVID connects with the
// instance value of the honest agent's stream, and answers every revoke
// "gone". When the honest stream closes under a revoke, the broker looks
// for the stream that took its requests over: the newest stream of the same
// SPIFFE ID and instance, which is the rogue, itself asked. Had the rogue's
// vote replaced the honest one, the rogue alone would have decided that the
// honest agent's grants are gone. A voter never replaces another voter: the
// closed stream did not answer, so the ids stay pending.
func TestRogueVoterCannotTakeOverAClosedInstanceVote(t *testing.T) {
	h := newHarness(t, 5*time.Second, func(cfg *ServerConfig) { cfg.MaxStreamsPerCluster = 8 })

	honestCtx, closeHonest := context.WithCancel(context.Background())
	defer closeHonest()
	honest := h.voterStream(t, honestCtx, agentA, "victim")
	rogueCtx, closeRogue := context.WithCancel(context.Background())
	defer closeRogue()
	rogue := h.voterStream(t, rogueCtx, agentA, "victim")

	// The honest stream closes when the revoke reaches it, unanswered.
	go func() {
		for {
			f, err := honest.Recv()
			if err != nil {
				return
			}
			if f.GetRevokeRequest() != nil {
				closeHonest()
				return
			}
		}
	}()
	// The rogue answers every id gone.
	go func() {
		for {
			f, err := rogue.Recv()
			if err != nil {
				return
			}
			if req := f.GetRevokeRequest(); req != nil {
				_ = rogue.Send(&pb.AgentFrame{CorrelationId: f.GetCorrelationId(), Body: &pb.AgentFrame_RevokeResponse{
					RevokeResponse: &pb.RevokeResponse{CredentialIds: req.GetCredentialIds()}}})
			}
		}
	}()

	got, err := h.srv.Revoke(context.Background(), clusterA, []string{"JTI=held"}, "test")
	assert.Empty(t, got, "the rogue's vote replaced the closed honest stream's: an id the honest agent holds was counted gone")
	assert.Equal(t, codes.Unavailable, errdefs.Code(err), "%v", err)
}
