# credbroker: a hub-and-spoke credential broker for ClusterProfile fleets.
# Run `make help` for the targets. Nothing here downloads a prebuilt binary:
# every tool and test server is built from the Go module proxy.

SHELL := /usr/bin/env bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

GO        ?= go
BIN       ?= bin
TOOLS     := $(GO) tool -modfile=hack/tools/go.mod
TESTBIN   := hack/testbin.sh
SPIRE     := hack/spire.sh
# Tests that start API servers find them through KUBEBUILDER_ASSETS, and
# those that start SPIRE find spire-server and spire-agent through
# CREDBROKER_SPIRE.
ASSETS     = KUBEBUILDER_ASSETS="$$($(TESTBIN))"
SPIRE_BIN  = CREDBROKER_SPIRE="$$($(SPIRE))"
# Every run shuffles the order of tests with a seed of its own, printed
# first, so that a failure that depends on the order can be run again with
# SHUFFLE=<seed>.
ifndef SHUFFLE
SHUFFLE := $(shell echo $$RANDOM$$RANDOM)
endif
TEST_FLAGS ?= -race -shuffle=$(SHUFFLE) -timeout 40m
BENCH_FLAGS ?= -benchtime 200x -count 1

BINARIES := broker spoke-agent credbroker-plugin credbroker
# The images hold the three binaries that run in a cluster.
IMAGES   := broker spoke-agent credbroker-plugin

# The release version (VERSION) and the commit, "-dirty" when the tree has
# changes, are linked into internal/version; `--version` prints them.
VERSION  := $(shell cat VERSION)
REVISION := $(shell git rev-parse HEAD 2>/dev/null)$(shell [[ -z "$$(git status --porcelain 2>/dev/null)" ]] || echo -dirty)
VERSION_PKG := github.com/credbroker/credbroker/internal/version
LDFLAGS  := -X $(VERSION_PKG).Version=$(VERSION) -X $(VERSION_PKG).Revision=$(REVISION)

.PHONY: help
help: ## List the targets.
	@awk 'BEGIN {FS = ":.*## "} /^[a-z0-9-]+:.*## / {printf "  %-15s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

.PHONY: build
build: ## Build broker, spoke-agent, credbroker-plugin and credbroker into ./bin, static as the images hold them.
	@mkdir -p $(BIN)
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN)/ $(addprefix ./cmd/,$(BINARIES))

.PHONY: images
images: ## Write OCI image tarballs of broker, spoke-agent and credbroker-plugin to ./bin/images (no Docker daemon, no registry).
	@mkdir -p $(BIN)/images
	cd hack/images && $(GO) run . --root ../.. --out ../../$(BIN)/images --version '$(VERSION)' --revision '$(REVISION)' $(IMAGES)

.PHONY: generate
generate: ## Regenerate the gRPC code from proto/ with the pinned buf and plugins.
	$(TOOLS) buf generate

.PHONY: generate-check
generate-check: ## Fail when the committed generated code is not what `make generate` writes.
	hack/generate-check.sh

.PHONY: lint
lint: ## Run gofmt, go vet and staticcheck (pinned in hack/tools).
	@out=$$(gofmt -l $$(git ls-files --cached --others --exclude-standard '*.go')); \
	  if [[ -n "$$out" ]]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(TOOLS) staticcheck ./...

.PHONY: testbin
testbin: ## Build kube-apiserver, kubectl and etcd for the tests into the version-keyed cache (about 6 min cold).
	@$(TESTBIN) >/dev/null

.PHONY: spire
spire: ## Build spire-server and spire-agent for the tests into the version-keyed cache (about 7.5 min cold).
	@$(SPIRE) >/dev/null

.PHONY: test
test: testbin spire ## Run every test, integration and e2e included, with -race, on real API servers (SHUFFLE=<seed> repeats an order).
	@echo "make test: shuffle seed $(SHUFFLE) (SHUFFLE=$(SHUFFLE) runs this order again)"
	$(ASSETS) $(SPIRE_BIN) $(GO) test $(TEST_FLAGS) ./...
	cd test/monitoring && $(GO) test $(TEST_FLAGS) -count=1 ./...
	cd hack/images && $(GO) test $(TEST_FLAGS) ./...

.PHONY: e2e
e2e: testbin spire ## Run only the end-to-end tests (one hub, two spokes), and the shipped binaries under deploy/ RBAC.
	$(ASSETS) $(SPIRE_BIN) $(GO) test $(TEST_FLAGS) -v ./test/e2e/... ./test/binaries/...

# Mutation testing (make mutate): the packages that hold trust decisions,
# each as pkg:efficacy-floor:coverage-floor in percent. Raise a floor when a
# package does better; never lower one to pass. See docs/testing.md.
MUTATE_PKGS ?= \
	tokenexchange:100:94 \
	spoke:99:86 \
	clusterprofile:100:90 \
	tunnel:98:98 \
	token:100:98 \
	plugin:100:100 \
	identity:100:83

.PHONY: mutate
mutate: testbin ## Mutation-test the trust packages with gremlins; fails below each package's floor (slow: not in CI).
	$(ASSETS) hack/mutate.sh $(MUTATE_PKGS)

.PHONY: bench
bench: testbin build ## Benchmark the shipped binaries on real API servers against same-run baselines; prints the table and writes it to docs/benchmarks.md (under 10 min).
	$(ASSETS) CREDBROKER_BENCH=1 CREDBROKER_BENCH_BIN=$(CURDIR)/$(BIN) CREDBROKER_BENCH_OUT=$(CURDIR)/$(BIN)/bench \
	  CREDBROKER_BENCH_DOC=$(CURDIR)/docs/benchmarks.md $(GO) test -count 1 -timeout 10m -run '^TestBench$$' -v ./test/bench/

.PHONY: bench-fleet
bench-fleet: testbin build ## Benchmark scenario f apart from make bench: one broker process with 10,000 ClusterProfiles and 10,000 simulated agent streams; writes its table to docs/benchmarks.md.
	$(ASSETS) CREDBROKER_BENCH=1 CREDBROKER_BENCH_BIN=$(CURDIR)/$(BIN) CREDBROKER_BENCH_OUT=$(CURDIR)/$(BIN)/bench \
	  CREDBROKER_BENCH_DOC=$(CURDIR)/docs/benchmarks.md $(GO) test -count 1 -timeout 20m -run '^TestBenchFleet$$' -v ./test/bench/

.PHONY: bench-go
bench-go: ## Run the packages' Go benchmarks (compare runs with benchstat) and the in-process exchange benchmark.
	$(GO) test -run '^$$' -bench . -benchmem -count $(or $(COUNT),6) ./pkg/store/ ./pkg/tokenexchange/ ./pkg/spoke/ ./pkg/clusterprofile/
	$(ASSETS) $(GO) test -run '^$$' -bench . $(BENCH_FLAGS) ./test/e2e/...

.PHONY: soak
soak: testbin ## Soak the broker and agent binaries for SOAK_DURATION (default 10m) of mixed load with restarts, and churn for 2m; not in CI.
	$(ASSETS) CHURN_DURATION=$${CHURN_DURATION:-2m} $(GO) test -tags soak -count=1 -timeout 90m -v \
	  -run '^(TestSoak|TestChurn)$$' ./test/faults/

.PHONY: fuzz
fuzz: ## Run every fuzz target for FUZZTIME each (default 30s); not part of `make test`, which runs their seeds.
	hack/fuzz.sh

.PHONY: demo
demo: testbin build ## Start a hub, two spokes, bin/broker and a bin/spoke-agent each; list namespaces on both as a consumer, three ways.
	$(ASSETS) $(GO) run ./test/demo --plugin=$(BIN)/credbroker-plugin --cli=$(BIN)/credbroker --broker=$(BIN)/broker --agent=$(BIN)/spoke-agent
