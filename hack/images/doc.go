// Command images writes OCI image tarballs of credbroker's binaries without
// a Docker daemon and without pulling anything from an image registry.
//
// For each binary named on the command line it builds ./cmd/<binary> of the
// repository at --root as a static executable (CGO_ENABLED=0, -trimpath,
// the version ldflags of the Makefile) for linux and the machine's GOARCH,
// and writes <out>/<binary>.tar with go-containerregistry: an empty base and
// one layer holding /<binary>, entrypoint ["/<binary>"], user 65532:65532,
// and the org.opencontainers.image.* labels (title, version, revision,
// source, created; no licenses label while the
// repository has no LICENSE file). The image is tagged
// ghcr.io/credbroker/<binary>:<version>. The tarball is written with
// tarball.WriteToFile, the format of `docker save` (manifest.json, the
// config and the gzipped layer; it records no media types, and readers
// give the image Docker's): `docker load -i`, `podman load -i` and
// `crane push` read it. It is not an OCI image layout.
//
// Every time in the image (created, the file's mtime) is the commit time of
// --revision, so two builds of one commit write the same image.
//
// It lives in a module of its own so that go-containerregistry stays out of
// the main go.mod. `make images` runs it:
//
//	go run . --root ../.. --out ../../bin/images --version v0.1.0 --revision <sha> broker spoke-agent credbroker-plugin
package main
