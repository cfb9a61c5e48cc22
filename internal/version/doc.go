// Package version tells which build of credbroker is running.
//
// The Makefile sets Version (from the VERSION file) and Revision (the git
// commit, with a "-dirty" suffix when the tree had changes) with
//
//	-ldflags "-X github.com/credbroker/credbroker/internal/version.Version=v0.1.0
//	          -X github.com/credbroker/credbroker/internal/version.Revision=<sha>"
//
// A binary built without them (go build, go install, go test) falls back to
// what the Go toolchain recorded: the module version and the vcs.revision and
// vcs.modified build settings of debug.ReadBuildInfo.
package version
