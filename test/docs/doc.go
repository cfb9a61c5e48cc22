// Package docs checks the documentation against the binaries: the docs and
// deploy/ mention no flag the binaries lack and every flag they have, the
// Flags section of docs/operations.md is what their --help says, the import
// table of docs/architecture.md is what go list says, every test the docs
// name exists, and the license rules hold. It holds tests only:
//
//	go test ./test/docs/
//	go test ./test/docs -run TestFlagReference -args -update  # rewrite the flag reference
package docs
