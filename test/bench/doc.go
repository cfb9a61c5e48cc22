// Package bench is credbroker's benchmark suite, which `make bench` runs: the
// shipped broker and spoke-agent binaries, as separate processes with the
// flags an operator would pass, against real API servers started by
// test/framework, under concurrent load over loopback TLS.
//
// Every figure is a distribution beside, or a ratio to, a baseline measured
// in the same run at the same concurrency: a gRPC echo over the same
// certificate, direct TokenRequests on the same spoke API server, and
// direct TokenReview + SubjectAccessReview + TokenRequest calls, and
// cluster-inventory-api's secretreader exec plugin, built from the module
// cache, beside credbroker-plugin run as client-go runs it. No test
// asserts a time; the herd scenario asserts a count, taken from the spoke
// API server's own apiserver_request_total.
//
// The suite runs only when CREDBROKER_BENCH is set (the Makefile sets it),
// so `go test ./...` and `make test` skip it. It prints one table and, when
// CREDBROKER_BENCH_DOC names a file, writes the table into it between the
// markers <!-- bench:begin --> and <!-- bench:end -->. See docs/benchmarks.md.
package bench
