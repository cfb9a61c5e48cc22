// Package examples holds no Go code of its own: deploy/examples is example
// manifests and files for consumers of the broker. Its tests check them
// against the formats of the programs that read them:
//
//	go test ./deploy/examples/
package examples
