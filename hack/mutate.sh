#!/usr/bin/env bash
# mutate.sh runs gremlins (pinned in hack/tools) on each package named by
# its arguments, prints test efficacy and mutator coverage per package, and
# fails when a package is below its floors.
#
# Usage: hack/mutate.sh PKG:EFFICACY:COVERAGE...   (PKG under pkg/, floors in %)
# GREMLINS_FLAGS replaces the flags given to `gremlins unleash` (default:
# a timeout of 20 times the package's covered test run, so that a loaded
# machine does not turn slow tests into TIMED OUT mutants, which count
# neither as killed nor as lived).
# Each package's full report, with the LIVED mutants, is left in
# $MUTATE_OUT (default bin/mutate/<pkg>.log).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${MUTATE_OUT:-bin/mutate}
mkdir -p "$out"
gremlins=(go tool -modfile=hack/tools/go.mod gremlins)
# gremlins times each mutant's test run against its first, covered run of
# the package. A cached result of that run takes a fraction of a second, so
# every mutant whose tests take longer would count as TIMED OUT: never read
# test results from the cache here.
export GOFLAGS="${GOFLAGS:+$GOFLAGS }-count=1"

summary=()
failed=()
for spec in "$@"; do
	IFS=: read -r pkg eff_floor cov_floor <<<"$spec"
	log="$out/$pkg.log"
	echo "mutate: pkg/$pkg (floors: efficacy ${eff_floor}%, coverage ${cov_floor}%), report in $log" >&2
	start=$SECONDS
	# gremlins exits non-zero on its own thresholds only; we compare below so
	# that every package is measured before the target fails.
	if ! "${gremlins[@]}" unleash ${GREMLINS_FLAGS:---timeout-coefficient 20} "./pkg/$pkg" >"$log" 2>&1; then
		failed+=("$pkg: gremlins failed, see $log")
		summary+=("$(printf '%-16s %10s %10s %8s' "$pkg" error error "$((SECONDS - start))s")")
		continue
	fi
	eff=$(sed -n 's/^.*Test efficacy: \([0-9.]*\)%.*$/\1/p' "$log" | tail -1)
	cov=$(sed -n 's/^.*Mutator coverage: \([0-9.]*\)%.*$/\1/p' "$log" | tail -1)
	counts=$(grep -E 'Killed: [0-9]+, Lived' "$log" | tail -1 | sed 's/^.*\(Killed\)/\1/')
	summary+=("$(printf '%-16s %9s%% %9s%% %8s   %s' "$pkg" "${eff:-?}" "${cov:-?}" "$((SECONDS - start))s" "$counts")")
	if [[ -z "$eff" || -z "$cov" ]]; then
		failed+=("$pkg: no figures in $log")
		continue
	fi
	if awk -v v="$eff" -v f="$eff_floor" 'BEGIN { exit !(v < f) }'; then
		failed+=("$pkg: test efficacy ${eff}% is below its floor ${eff_floor}%; LIVED mutants: grep LIVED $log")
	fi
	if awk -v v="$cov" -v f="$cov_floor" 'BEGIN { exit !(v < f) }'; then
		failed+=("$pkg: mutator coverage ${cov}% is below its floor ${cov_floor}%; NOT COVERED mutants: grep 'NOT COVERED' $log")
	fi
done

printf '\n%-16s %10s %10s %8s\n' package efficacy coverage time
printf '%s\n' "${summary[@]}"
if ((${#failed[@]} > 0)); then
	printf '\nmutate: FAILED\n' >&2
	printf '  %s\n' "${failed[@]}" >&2
	exit 1
fi
