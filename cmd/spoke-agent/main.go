package main

import (
	"os"

	"github.com/credbroker/credbroker/internal/cmdflags"
	"github.com/credbroker/credbroker/pkg/agent"
)

func main() {
	cfg, err := parseFlags(os.Args[1:])
	cmdflags.ExitOnParse("spoke-agent", err)
	cmdflags.Serve(cfg.Log, "agent stopped", agent.New, cfg)
}
