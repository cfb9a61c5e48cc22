#!/usr/bin/env bash
# Runs every Go fuzz target of the module for FUZZTIME each (30s by
# default) and prints the executions of each. A failing input is written by
# `go test` under the package's testdata/fuzz/<Target>/; commit it as a
# regression input once fixed.
set -euo pipefail
cd "$(dirname "$0")/.."
fuzztime=${FUZZTIME:-30s}
status=0
while IFS=: read -r file target; do
	pkg=./$(dirname "$file")
	out=$(go test -run '^$' -fuzz "^${target}\$" -fuzztime "$fuzztime" "$pkg" 2>&1) || status=1
	execs=$(grep -o 'execs: [0-9]*' <<<"$out" | tail -1 | cut -d' ' -f2 || true)
	printf '%-40s %-28s %s execs%s\n' "$pkg" "$target" "${execs:-?}" "$([[ $out == *FAIL* ]] && echo '  FAILED' || true)"
	if [[ $out == *FAIL* ]]; then echo "$out" | tail -20; fi
done < <(git grep -o '^func Fuzz[A-Za-z0-9_]*' -- '*_test.go' | sed 's/func //')
exit $status
