package main

import (
	"os"

	"sigs.k8s.io/cluster-inventory-api/pkg/credentialplugin"
)

func main() {
	p, err := newProvider(os.Args[1:])
	exitOnParse(err)
	credentialplugin.Run(p) // exits 1 on failure
}
