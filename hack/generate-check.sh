#!/usr/bin/env bash
# Fails when the committed generated code differs from what `make generate`
# writes. It generates into a scratch folder, so the work tree is untouched.
set -euo pipefail

cd "$(dirname "$0")/.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

go tool -modfile=hack/tools/go.mod buf generate --output "$out"
stale=0
while IFS= read -r -d '' f; do
	rel=${f#"$out"/}
	if ! cmp -s "$f" "$rel"; then
		echo "generate-check: $rel is stale; run 'make generate' and commit the result" >&2
		stale=1
	fi
done < <(find "$out" -name '*.go' -print0)
while IFS= read -r -d '' f; do
	if [[ ! -e "$out/$f" ]]; then
		echo "generate-check: $f is no longer generated; delete it" >&2
		stale=1
	fi
done < <(find proto -name '*.pb.go' -print0)
exit $stale
