#!/usr/bin/env bash
# The serving measurement of one device call (docs/serving.md): installs SGLang's client from the
# folder scripts/client_wheels.sh built (WHEELS, default ./.whl; carry it), runs `dsaspec serve`
# (e2e preset, NEXTN, 3 steps, simulated accept 3.0) under it with the kill switches off at
# BASELINE_CONCURRENCY (default "1 32"), then the new path with E2E=1 at CONCURRENCY (default
# "1 8 32") against that baseline. Run folders under $OUT/serving_{baseline,new}; the reports
# (benchmarks/results/h200/serving*.{json,md,png}) copied to $OUT. About 480 s on the H200.
#   OUT=/path WHEELS=/path/.whl bash scripts/gpu_serving.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -gt 0 ]; then echo "gpu_serving.sh: takes no arguments (set OUT, WHEELS, CONCURRENCY, BASELINE_CONCURRENCY)" >&2; exit 2; fi
if [ -z "${OUT:-}" ]; then echo "gpu_serving.sh: set OUT to the folder the runs and reports go to" >&2; exit 2; fi
wheels=${WHEELS:-$PWD/.whl}
if [ ! -d "$wheels/sgl" ]; then
    echo "gpu_serving.sh: no SGLang client folder at $wheels/sgl (build it with bash scripts/client_wheels.sh; WHEELS)" >&2; exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile "$wheels"/*.whl
export SGLANG_CLIENT=$wheels/sgl DSASPEC_SIMULATE_ACCEPT_LEN=3.0 MACHINE=h200 PRESET=e2e PYTHON=python3
spec=(--speculative-algorithm NEXTN --speculative-num-steps 3)
WORK=$OUT/serving_baseline NAME=serving_baseline CONCURRENCY=${BASELINE_CONCURRENCY:-"1 32"} \
    DSASPEC_BOUNDED_REPLAY_METADATA=0 DSASPEC_SPEC_DRAFT_ARGMAX_EXCHANGE=0 DSASPEC_SPEC_VERIFY_ARGMAX_EXCHANGE=0 \
    scripts/bench_serving.sh "${spec[@]}"
WORK=$OUT/serving_new E2E=1 CONCURRENCY=${CONCURRENCY:-"1 8 32"} BASELINE=benchmarks/results/h200/serving_baseline.json \
    scripts/bench_serving.sh "${spec[@]}"
cp benchmarks/results/h200/serving*.json benchmarks/results/h200/serving*.md benchmarks/results/h200/serving*.png "$OUT"/
