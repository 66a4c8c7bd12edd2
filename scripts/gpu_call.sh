#!/usr/bin/env bash
# One device call, several steps, each skipped when the call's time budget would not cover it:
#   bash scripts/gpu_call.sh BUDGET_S "NAME:EST_S:COMMAND" ...
# Logs go to $OUT/logs/NAME.log; a summary line per step is printed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
budget=$1; shift
mkdir -p "$OUT/logs"
start=$SECONDS
for spec in "$@"; do
  name=${spec%%:*}; rest=${spec#*:}; est=${rest%%:*}; cmd=${rest#*:}
  left=$((budget - (SECONDS - start)))
  if [ "$left" -lt "$est" ]; then echo "== $name: skipped ($left s left, needs ~$est s)"; continue; fi
  t0=$SECONDS
  timeout "$left" bash -c "$cmd" > "$OUT/logs/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc in $((SECONDS - t0)) s; $(grep -E 'passed|failed|ERROR SUMMARY|results:' "$OUT/logs/$name.log" | tail -1)"
done
