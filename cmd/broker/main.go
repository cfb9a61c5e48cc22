// Command broker runs the hub side of credbroker: TokenExchange for
// consumers and AgentTunnel for spoke agents.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/credbroker/credbroker/pkg/broker"
)

func main() {
	cfg, err := parseFlags(os.Args[1:])
	if err != nil {
		fmt.Fprintf(os.Stderr, "broker: %v\n", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg); err != nil {
		cfg.Log.Error(err, "broker stopped")
		os.Exit(1)
	}
}

func run(ctx context.Context, cfg broker.Config) error {
	b, err := broker.New(cfg)
	if err != nil {
		return err
	}
	return b.Run(ctx)
}
