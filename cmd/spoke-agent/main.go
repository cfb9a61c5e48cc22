// Command spoke-agent runs the spoke side of credbroker: it holds a stream to
// every broker replica and mints ServiceAccount tokens under the spoke's
// policy.
package main

import (
	"context"
	"os"

	"github.com/credbroker/credbroker/internal/cmdflags"
	"github.com/credbroker/credbroker/pkg/agent"
)

func main() {
	cfg, err := parseFlags(os.Args[1:])
	cmdflags.ExitOnParse("spoke-agent", err)
	cmdflags.Run(cfg.Log, "agent stopped", func(ctx context.Context) error { return run(ctx, cfg) })
}

func run(ctx context.Context, cfg agent.Config) error {
	a, err := agent.New(cfg)
	if err != nil {
		return err
	}
	return a.Run(ctx)
}
