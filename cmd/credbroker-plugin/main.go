package main

import (
	"fmt"
	"os"

	"sigs.k8s.io/cluster-inventory-api/pkg/credentialplugin"

	"github.com/credbroker/credbroker/internal/cmdflags"
	"github.com/credbroker/credbroker/pkg/plugin"
)

func main() {
	p, err := newProvider(os.Args[1:])
	switch {
	case cmdflags.IsHelpOrVersion(err):
		cmdflags.ExitOnParse("credbroker-plugin", err)
	case err != nil:
		fmt.Fprintf(os.Stderr, "[%s] %v\n", plugin.Name, err)
		os.Exit(2)
	}
	credentialplugin.Run(p) // exits 1 on failure
}
