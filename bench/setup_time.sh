#!/usr/bin/env bash
# The README's set-up commands timed from fresh clones of two commits, one after another, and their ratio.
#   bash bench/setup_time.sh BEFORE AFTER [ROUNDS]      e.g. bash bench/setup_time.sh 582556d ca5d841 2
# Each run: `git clone` of this repository into a temporary folder (beside a link to ../shared, as the tests
# expect), `git checkout COMMIT`, then `bash scripts/setup.sh [EXTRAS]` timed with PYTHONDONTWRITEBYTECODE unset;
# warm (caches as they are) for both commands, ROUNDS times (default 1), then once cold for the second command
# (PIP_NO_CACHE_DIR=1 and UV_NO_CACHE=1: no package cache for pip or uv). Run it with nothing else on the machine.
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: bash bench/setup_time.sh BEFORE AFTER [ROUNDS]" >&2; exit 2; }
repo=$(cd "$(dirname "$0")/.." && pwd)
unset PYTHONDONTWRITEBYTECODE
once() {  # COMMIT EXTRAS ENV: seconds, or FAIL
  local d; d=$(mktemp -d)
  [ -e "$repo/../shared" ] && ln -s "$(cd "$repo/../shared" && pwd)" "$d/shared"
  git clone -q "$repo" "$d/p" && git -C "$d/p" checkout -q "$1" || { echo FAIL; return; }
  local s e; s=$(date +%s.%N)
  if (cd "$d/p" && env $3 bash scripts/setup.sh $2 >"$d/log" 2>&1); then e=$(date +%s.%N); printf '%.1f\n' "$(echo "$e - $s" | bc)"
  else echo FAIL; tail -n 5 "$d/log" >&2; fi
  rm -rf "$d"
}
row() {  # LABEL EXTRAS ENV
  local b a; b=$(once "$1" "$3" "$4"); a=$(once "$2" "$3" "$4")
  printf '%-42s before %7s s   after %7s s   ratio %s\n' "$5" "$b" "$a" \
    "$(python3 -c "print(f'{float(\"$b\") / float(\"$a\"):.1f}x')" 2>/dev/null || echo -)"
}
for r in $(seq "${3:-1}"); do
  row "$1" "$2" "" "X=1" "setup.sh (warm, round $r)"
  row "$1" "$2" "dev,interp,eval" "X=1" "setup.sh dev,interp,eval (warm, round $r)"
done
row "$1" "$2" "dev,interp,eval" "PIP_NO_CACHE_DIR=1 UV_NO_CACHE=1" "setup.sh dev,interp,eval (cold)"
