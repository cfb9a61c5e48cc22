// Command spoke-agent runs the spoke side of credbroker: it holds a stream to
// every broker replica and mints ServiceAccount tokens under the spoke's
// policy.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/credbroker/credbroker/pkg/agent"
)

func main() {
	cfg, err := parseFlags(os.Args[1:])
	if err != nil {
		fmt.Fprintf(os.Stderr, "spoke-agent: %v\n", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg); err != nil {
		cfg.Log.Error(err, "agent stopped")
		os.Exit(1)
	}
}

func run(ctx context.Context, cfg agent.Config) error {
	a, err := agent.New(cfg)
	if err != nil {
		return err
	}
	return a.Run(ctx)
}
