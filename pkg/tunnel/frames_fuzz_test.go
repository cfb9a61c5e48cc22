package tunnel

import (
	"errors"
	"slices"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/credbroker/credbroker/pkg/errdefs"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// FuzzAgentFrame feeds the broker arbitrary frames as an agent's answer to
// a mint and to a revoke. An accepted mint answer carries a well-shaped
// token and an expiry; a refusal carries only a code an agent may give; a
// revoke answer reports gone only ids that were asked, once each.
func FuzzAgentFrame(f *testing.F) {
	seed := func(fr *pb.AgentFrame) {
		b, err := proto.Marshal(fr)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	seed(&pb.AgentFrame{Body: &pb.AgentFrame_MintResponse{MintResponse: &pb.MintResponse{
		Token: "eyJhbGciOiJSUzI1NiJ9.eyJqdGkiOiJ4In0.c2ln", ExpirationTime: timestamppb.Now()}}})
	seed(&pb.AgentFrame{Body: &pb.AgentFrame_MintResponse{MintResponse: &pb.MintResponse{Token: "a.b"}}})
	seed(&pb.AgentFrame{Body: &pb.AgentFrame_Error{Error: &pb.Error{Code: int32(codes.Unauthenticated), Message: "\x1b[31mx"}}})
	seed(&pb.AgentFrame{Body: &pb.AgentFrame_RevokeResponse{RevokeResponse: &pb.RevokeResponse{CredentialIds: []string{"a", "a", "z"}}}})
	seed(&pb.AgentFrame{})
	f.Add([]byte{0xff, 0xff, 0xff})
	asked := []string{"a", "b"}
	f.Fuzz(func(t *testing.T, data []byte) {
		var fr pb.AgentFrame
		if proto.Unmarshal(data, &fr) != nil {
			return
		}
		if r, err := answerOf(&fr); err == nil {
			if r.GetToken() == "" || r.GetExpirationTime() == nil {
				t.Fatalf("accepted an answer without a token or an expiry: %v", r)
			}
		} else {
			if code := errdefs.Code(err); !slices.Contains(agentCodes, code) {
				t.Fatalf("an agent's answer became code %s", code)
			}
			assertFitForConsumer(t, err.Error())
		}
		gone, _, err := revokeAnswerOf(&fr, asked)
		if err != nil && !errors.Is(err, errdefs.ErrUnavailable) && !slices.Contains(agentCodes, errdefs.Code(err)) {
			t.Fatalf("a revoke answer became code %s", errdefs.Code(err))
		}
		seen := map[string]bool{}
		for _, id := range gone {
			if !slices.Contains(asked, id) || seen[id] {
				t.Fatalf("gone %q: not asked, or twice, in %q", id, gone)
			}
			seen[id] = true
		}
	})
}
