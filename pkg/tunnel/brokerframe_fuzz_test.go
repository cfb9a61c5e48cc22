package tunnel

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// echoMinter records the request it is given and answers by its mode: a
// token, a refusal, or nothing at all.
type echoMinter struct {
	mode     byte
	got      []*pb.MintRequest
	clusters []fleet.ClusterRef
}

const fuzzToken = "eyJhbGciOiJSUzI1NiJ9.eyJqdGkiOiJmdXp6In0.c2ln"

func (m *echoMinter) Mint(_ context.Context, cluster fleet.ClusterRef, req *pb.MintRequest) (*pb.MintResponse, error) {
	m.got, m.clusters = append(m.got, req), append(m.clusters, cluster)
	switch m.mode % 3 {
	case 0:
		return &pb.MintResponse{Token: fuzzToken, ExpirationTime: timestamppb.Now()}, nil
	case 1:
		return nil, fmt.Errorf("service account %q does not allow you: %w", req.GetServiceAccount().GetName(), errdefs.ErrPermissionDenied)
	default:
		return nil, nil
	}
}

// echoGrants records the revoke requests it is given and answers them.
type echoGrants struct {
	got      []*pb.RevokeRequest
	clusters []fleet.ClusterRef
}

func (g *echoGrants) Snapshot() []*pb.Grant                                { return nil }
func (g *echoGrants) Removed() []string                                    { return nil }
func (g *echoGrants) Subscribe(func(*pb.GrantUpdate)) (unsubscribe func()) { return func() {} }
func (g *echoGrants) Revoke(_ context.Context, cluster fleet.ClusterRef, req *pb.RevokeRequest) (*pb.RevokeResponse, error) {
	g.got, g.clusters = append(g.got, req), append(g.clusters, cluster)
	if len(req.GetCredentialIds()) == 0 {
		return nil, fmt.Errorf("nothing to revoke: %w", errdefs.ErrInvalidArgument)
	}
	return &pb.RevokeResponse{CredentialIds: req.GetCredentialIds()}, nil
}

// FuzzBrokerFrame feeds the agent's end of the tunnel arbitrary frames as
// the broker's. A mint or revoke request is handed to the Minter or the
// Grants exactly as it came, once, with the admitted cluster, and answered with one frame of the same
// correlation id: the token, the revoked ids, or a refusal whose code is not
// OK; a revoke to an agent without Grants is FailedPrecondition. A drain is
// reported as such, and any other frame is left unanswered and reaches
// neither.
func FuzzBrokerFrame(f *testing.F) {
	seed := func(fr *pb.BrokerFrame, mode byte, grants bool) {
		b, err := proto.Marshal(fr)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b, mode, grants)
	}
	mint := &pb.MintRequest{ServiceAccount: &pb.ObjectReference{Namespace: "spoke", Name: "reader"}, Audiences: []string{"a"}}
	seed(&pb.BrokerFrame{CorrelationId: "c1", Body: &pb.BrokerFrame_MintRequest{MintRequest: mint}}, 0, true)
	seed(&pb.BrokerFrame{CorrelationId: "c2", Body: &pb.BrokerFrame_MintRequest{MintRequest: mint}}, 1, false)
	seed(&pb.BrokerFrame{Body: &pb.BrokerFrame_MintRequest{MintRequest: &pb.MintRequest{}}}, 2, true)
	seed(&pb.BrokerFrame{CorrelationId: "c3", Body: &pb.BrokerFrame_RevokeRequest{RevokeRequest: &pb.RevokeRequest{CredentialIds: []string{"x", "y"}}}}, 0, true)
	seed(&pb.BrokerFrame{CorrelationId: "c4", Body: &pb.BrokerFrame_RevokeRequest{RevokeRequest: &pb.RevokeRequest{}}}, 0, false)
	seed(&pb.BrokerFrame{Body: &pb.BrokerFrame_Drain{Drain: &pb.Drain{}}}, 0, true)
	seed(&pb.BrokerFrame{CorrelationId: "c5"}, 0, true)
	f.Add([]byte{0xff, 0x01}, byte(0), true)
	f.Fuzz(func(t *testing.T, data []byte, mode byte, withGrants bool) {
		var fr pb.BrokerFrame
		if proto.Unmarshal(data, &fr) != nil {
			return
		}
		minter := &echoMinter{mode: mode}
		grants := &echoGrants{}
		cfg := ClientConfig{Address: "broker:443", Credentials: insecure.NewCredentials(), Minter: minter}
		if withGrants {
			cfg.Grants = grants
		}
		c, err := NewClient(cfg)
		if err != nil {
			t.Fatal(err)
		}
		handle, drain := c.request(&fr, clusterA)
		switch body := fr.GetBody().(type) {
		case *pb.BrokerFrame_Drain:
			if !drain || handle != nil {
				t.Fatalf("a drain read as drain=%v, handled=%v", drain, handle != nil)
			}
			return
		case *pb.BrokerFrame_MintRequest, *pb.BrokerFrame_RevokeRequest:
			if drain || handle == nil {
				t.Fatalf("a request read as drain=%v, handled=%v", drain, handle != nil)
			}
			answer := handle(t.Context())
			if answer.GetCorrelationId() != fr.GetCorrelationId() {
				t.Fatalf("answered %q to request %q", answer.GetCorrelationId(), fr.GetCorrelationId())
			}
			if e := answer.GetError(); e != nil {
				if codes.Code(e.GetCode()) == codes.OK {
					t.Fatalf("a refusal with code OK: %v", e)
				}
				if strings.Contains(e.GetMessage(), fuzzToken) {
					t.Fatal("a refusal carries a token")
				}
			}
			if m, ok := body.(*pb.BrokerFrame_MintRequest); ok {
				if len(minter.got) != 1 || !proto.Equal(minter.got[0], m.MintRequest) || len(grants.got) != 0 {
					t.Fatalf("the Minter got %v for %v, the Grants %d requests", minter.got, m.MintRequest, len(grants.got))
				}
				if minter.clusters[0] != clusterA {
					t.Fatalf("the Minter got cluster %v, not the admitted %v", minter.clusters[0], clusterA)
				}
				switch {
				case minter.mode%3 == 0 && answer.GetMintResponse().GetToken() != fuzzToken:
					t.Fatalf("the token was not answered: %v", answer)
				case minter.mode%3 != 0 && answer.GetError() == nil:
					t.Fatalf("a failed mint answered %v", answer)
				}
				return
			}
			r := body.(*pb.BrokerFrame_RevokeRequest)
			if len(minter.got) != 0 {
				t.Fatalf("a revoke reached the Minter")
			}
			if !withGrants {
				if codes.Code(answer.GetError().GetCode()) != codes.FailedPrecondition {
					t.Fatalf("a revoke to an agent without grants answered %v", answer)
				}
				return
			}
			if len(grants.got) != 1 || !proto.Equal(grants.got[0], r.RevokeRequest) || grants.clusters[0] != clusterA {
				t.Fatalf("the Grants got %v of %v for %v", grants.got, grants.clusters, r.RevokeRequest)
			}
			if answer.GetRevokeResponse() == nil && answer.GetError() == nil {
				t.Fatalf("a revoke answered neither ids nor a refusal: %v", answer)
			}
		default:
			if drain || handle != nil || len(minter.got) != 0 || len(grants.got) != 0 {
				t.Fatalf("an unknown frame %v was acted on", &fr)
			}
		}
	})
}
