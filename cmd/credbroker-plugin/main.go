package main

import (
	"errors"
	"flag"
	"fmt"
	"os"

	"sigs.k8s.io/cluster-inventory-api/pkg/credentialplugin"

	"github.com/credbroker/credbroker/pkg/plugin"
)

func main() {
	p, err := newProvider(os.Args[1:])
	switch {
	case errors.Is(err, flag.ErrHelp):
		printUsage(os.Stderr)
		os.Exit(0)
	case err != nil:
		fmt.Fprintf(os.Stderr, "[%s] %v\n", plugin.Name, err)
		os.Exit(2)
	}
	credentialplugin.Run(p) // exits 1 on failure
}
