// Command broker runs the hub side of credbroker: TokenExchange for
// consumers and AgentTunnel for spoke agents.
package main

import (
	"context"
	"os"

	"github.com/credbroker/credbroker/internal/cmdflags"
	"github.com/credbroker/credbroker/pkg/broker"
)

func main() {
	cfg, audit, err := parseFlags(os.Args[1:])
	cmdflags.ExitOnParse("broker", err)
	cmdflags.Run(cfg.Log, "broker stopped", func(ctx context.Context) error { return run(ctx, cfg) }, audit)
}

func run(ctx context.Context, cfg broker.Config) error {
	b, err := broker.New(cfg)
	if err != nil {
		return err
	}
	return b.Run(ctx)
}
