package tunnel

import (
	"fmt"
	"slices"

	"google.golang.org/grpc/codes"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/token"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// answerOf reads an agent's answer. An answer that is not a well-formed
// token is the agent's failure, so the consumer sees Unavailable, as for
// any answer that fails the exchange's checks.
func answerOf(f *pb.AgentFrame) (*pb.MintResponse, error) {
	switch body := f.GetBody().(type) {
	case *pb.AgentFrame_MintResponse:
		r := body.MintResponse
		if r.GetToken() == "" || r.GetExpirationTime() == nil {
			return nil, fmt.Errorf("the agent answered without a token or an expiry: %w", errdefs.ErrUnavailable)
		}
		if err := token.CheckShape(r.GetToken()); err != nil {
			return nil, fmt.Errorf("the agent answered with a malformed token: %w: %w", err, errdefs.ErrUnavailable)
		}
		return r, nil
	case *pb.AgentFrame_Error:
		return nil, agentError(body.Error)
	default:
		return nil, fmt.Errorf("the agent answered with an unexpected frame %T: %w", body, errdefs.ErrUnavailable)
	}
}

// revokeAnswerOf reads an agent's answer to a revoke of asked: the ids it
// says are gone, of those asked, once each, and how many others it named.
// The agent may be compromised; ids it was not asked about are not its to
// report gone.
func revokeAnswerOf(f *pb.AgentFrame, asked []string) (gone []string, foreign int, err error) {
	switch body := f.GetBody().(type) {
	case *pb.AgentFrame_RevokeResponse:
		want := make(map[string]bool, len(asked))
		for _, id := range asked {
			want[id] = true
		}
		for _, id := range body.RevokeResponse.GetCredentialIds() {
			if !want[id] {
				foreign++
				continue
			}
			want[id] = false // once
			gone = append(gone, id)
		}
		return gone, foreign, nil
	case *pb.AgentFrame_Error:
		return nil, 0, agentError(body.Error)
	default:
		return nil, 0, fmt.Errorf("the agent answered a revoke with an unexpected frame %T: %w", body, errdefs.ErrUnavailable)
	}
}

// agentError reads an agent's refusal. Its code is kept only if it is one
// an agent may give, and its message is made fit to show a consumer.
func agentError(e *pb.Error) error {
	code := codes.Code(e.GetCode())
	if !slices.Contains(agentCodes, code) {
		// Other codes describe the consumer's own call (its hub token,
		// its rate) and are not the agent's to give.
		code = codes.Unavailable
	}
	return errdefs.FromCode(code, "agent: "+agentMessage(e.GetMessage()))
}

// agentCodes are the codes an agent may answer with.
var agentCodes = []codes.Code{
	codes.PermissionDenied, codes.NotFound, codes.InvalidArgument, codes.FailedPrecondition,
	codes.Unavailable, codes.DeadlineExceeded, codes.Canceled, codes.Internal,
}
