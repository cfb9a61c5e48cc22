// Command etcd is etcd built from go.etcd.io/etcd/server/v3 for the tests.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
