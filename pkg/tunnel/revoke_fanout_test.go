package tunnel

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/stretchr/testify/assert"
	"google.golang.org/grpc/codes"

	"github.com/credbroker/credbroker/pkg/errdefs"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// The attack: whoever holds a cluster's agent SVID, without any spoke
// credential, connects next to the honest agent and answers every revoke
// "all gone". Had the broker sent each revoke to one stream, the revokes
// that reached the rogue would be reported done, and the honest agent,
// which holds the grants, would never delete them. Every revoke goes to
// every agent instance of the cluster, and an id is gone only when each of
// them says so.
func TestRogueInstanceCannotSwallowRevokes(t *testing.T) {
	honestly := func(_ context.Context, req *pb.RevokeRequest) (*pb.RevokeResponse, error) {
		// The honest agent could not delete JTI=held.
		return &pb.RevokeResponse{CredentialIds: slices.DeleteFunc(slices.Clone(req.GetCredentialIds()),
			func(id string) bool { return id == "JTI=held" })}, nil
	}
	tests := []struct {
		name     string
		rogue    func(ctx context.Context, req *pb.RevokeRequest) (*pb.RevokeResponse, error)
		want     []string // gone
		wantCode codes.Code
	}{
		{
			name: "the rogue answers every id gone",
			rogue: func(_ context.Context, req *pb.RevokeRequest) (*pb.RevokeResponse, error) {
				return &pb.RevokeResponse{CredentialIds: append(req.GetCredentialIds(), "JTI=foreign")}, nil
			},
			want: []string{"JTI=a"},
		},
		{
			name: "the rogue refuses",
			rogue: func(context.Context, *pb.RevokeRequest) (*pb.RevokeResponse, error) {
				return nil, fmt.Errorf("no: %w", errdefs.ErrUnavailable)
			},
			wantCode: codes.Unavailable,
		},
		{
			name: "the rogue does not answer",
			rogue: func(ctx context.Context, _ *pb.RevokeRequest) (*pb.RevokeResponse, error) {
				<-ctx.Done() // the test's end
				return nil, ctx.Err()
			},
			wantCode: codes.DeadlineExceeded,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			log := &lineLog{}
			h := newHarness(t, 300*time.Millisecond, func(cfg *ServerConfig) {
				cfg.Log = funcr.New(log.add, funcr.Options{})
				cfg.MaxStreamsPerCluster = 8
			})
			honest := &fakeAgentGrants{revoke: honestly}
			// The rogue's answers end with the test, before its agents stop.
			end, ended := context.WithCancel(context.Background())
			rogue := &fakeAgentGrants{revoke: func(ctx context.Context, req *pb.RevokeRequest) (*pb.RevokeResponse, error) {
				ctx, cancel := context.WithCancel(ctx)
				defer cancel()
				stop := context.AfterFunc(end, cancel)
				defer stop()
				return tt.rogue(ctx, req)
			}}
			h.agent(t, agentA, &fakeMinter{}, withAgentGrants(honest))
			for range 3 { // three instances of the rogue
				h.agent(t, agentA, &fakeMinter{}, withAgentGrants(rogue))
			}
			waitConnected(t, h, clusterA, 4)
			t.Cleanup(ended)

			// Whichever stream a round robin would pick first.
			const calls = 4
			for range calls {
				got, err := h.srv.Revoke(context.Background(), clusterA, []string{"JTI=a", "JTI=held"}, "test")
				assert.NotContains(t, got, "JTI=held", "an id the honest agent still holds was counted gone")
				assert.Equal(t, tt.want, got)
				if tt.wantCode != codes.OK {
					assert.Equal(t, tt.wantCode, errdefs.Code(err), "%v", err)
				} else {
					assert.NoError(t, err)
				}
			}
			honest.mu.Lock()
			defer honest.mu.Unlock()
			assert.Len(t, honest.revokes, calls, "a revoke did not reach the honest agent")
			if tt.wantCode == codes.OK {
				assert.Equal(t, calls, log.count("agents of one cluster disagree on a revoke; the ids stay pending"))
			}
		})
	}
}
