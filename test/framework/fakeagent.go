package framework

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// AdmitFakeAgent opens an AgentTunnel stream as a hand-written agent: it
// sends a hello with agentVersion and waits for the broker's admission
// header. The stream lives as long as ctx. Tests use it for agents that
// misbehave or that are simulated by the thousand.
func AdmitFakeAgent(ctx context.Context, client pb.AgentTunnelClient, agentVersion string) (grpc.BidiStreamingClient[pb.AgentFrame, pb.BrokerFrame], error) {
	return AdmitFakeAgentHello(ctx, client, &pb.Hello{AgentVersion: agentVersion})
}

// AdmitFakeAgentHello is AdmitFakeAgent with a hello of the caller's.
func AdmitFakeAgentHello(ctx context.Context, client pb.AgentTunnelClient, hello *pb.Hello) (grpc.BidiStreamingClient[pb.AgentFrame, pb.BrokerFrame], error) {
	sctx, cancel := context.WithCancel(ctx)
	stream, err := client.Connect(sctx)
	if err != nil {
		cancel()
		return nil, err
	}
	if err := stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_Hello{Hello: hello}}); err != nil {
		cancel()
		return nil, err
	}
	// A broker that never answers the hello ends the stream, not the caller.
	unanswered := time.AfterFunc(30*time.Second, cancel)
	md, err := stream.Header()
	if !unanswered.Stop() {
		err = fmt.Errorf("framework: no answer to the hello within 30s: %w", err)
	}
	if err != nil || len(md.Get("credbroker-cluster")) == 0 {
		cancel()
		return nil, errors.Join(err, fmt.Errorf("not admitted (headers: %v)", md))
	}
	context.AfterFunc(ctx, cancel)
	return stream, nil
}
