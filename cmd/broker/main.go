package main

import (
	"os"

	"github.com/credbroker/credbroker/internal/cmdflags"
	"github.com/credbroker/credbroker/pkg/broker"
)

func main() {
	cfg, audit, err := parseFlags(os.Args[1:])
	cmdflags.ExitOnParse("broker", err)
	cmdflags.Serve(cfg.Log, "broker stopped", broker.New, cfg, audit)
}
