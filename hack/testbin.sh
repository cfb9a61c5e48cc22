#!/usr/bin/env bash
# Builds kube-apiserver, etcd and kubectl from the Go module proxy into a
# cache folder keyed by their versions, and prints that folder. Nothing
# prebuilt is downloaded. A cold build takes about 6 minutes on 2 cores; a
# warm one is a no-op. kubectl renders deploy/ (kubectl kustomize) and runs
# the kubeconfigs that the tests and the demo generate.
set -euo pipefail

hack=$(cd "$(dirname "$0")" && pwd)
cd "$hack"

k8s=$(go list -m -f '{{.Version}}' k8s.io/kubernetes)
etcd=$(go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)
dir=${CREDBROKER_TESTBIN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/credbroker/testbin}/k8s-${k8s}_etcd-${etcd}

if [[ -x "$dir/kube-apiserver" && -x "$dir/etcd" && -x "$dir/kubectl" ]]; then
	echo "$dir"
	exit 0
fi

mkdir -p "$dir"
tmp=$(mktemp -d "$dir/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

echo "testbin: building kube-apiserver and kubectl $k8s and etcd $etcd into $dir (about 6 minutes the first time)" >&2
start=$SECONDS
# A folder made before kubectl joined keeps what it has.
[[ -x "$dir/etcd" ]] || go build -trimpath -ldflags='-s -w' -o "$tmp/etcd" ./cmd/etcd
[[ -x "$dir/kube-apiserver" ]] || go build -trimpath -ldflags='-s -w' -o "$tmp/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver
go build -trimpath -ldflags='-s -w' -o "$tmp/kubectl" k8s.io/kubernetes/cmd/kubectl
mv "$tmp"/* "$dir/"
echo "testbin: built in $((SECONDS - start))s" >&2
echo "$dir"
