#!/usr/bin/env bash
# GPU checks of the replay-metadata kernels, one step per argument (default: all):
#
#   tests     gpu-marked tests of the metadata / backend test modules        (~3-5 min)
#   bench     dsaspec bench metadata (bs 1..256 x live 1k/64k x 3 modes)     (~3-4 min)
#   draft     dsaspec bench draft-metadata (3/4 step backends, bs 1..256)    (~4 min)
#   tune      scripts/tune_metadata.py: knob sweep at live 64k vs same-bytes copy (~3-5 min)
#   sanitize  compute-sanitizer memcheck over every kernel path (if compute-sanitizer is on PATH)
#   ncu       Nsight Compute of target verify, bs 16, live 64k: default vs 16-byte aligned rows with
#             512-column blocks (if ncu is on PATH)
#
# Each step writes its log to $OUT/logs/<step>.log and its results (JSON/MD) to $OUT; without OUT,
# to benchmarks/results/<machine>/{logs/,}. Run the steps as separate commands where one command
# may last at most 10 minutes. Exit status: non-zero when any step failed or missed a target.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
RESULTS="${OUT:-benchmarks/results/$(python3 -c 'from dsaspec.bench.results import default_machine_dir as d; print(d())')}"
LOGS="$RESULTS/logs"
mkdir -p "$LOGS"
status=0

step() {
    local name=$1; shift
    local start=$SECONDS
    echo "== $name: $*" | tee "$LOGS/$name.log"
    "$@" 2>&1 | tee -a "$LOGS/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$LOGS/$name.log"
    [ "$rc" -eq 0 ] || status=1
}

for what in "${@:-tests bench draft tune sanitize ncu}"; do
  for name in $what; do
    case "$name" in
      tests) step gpu_tests_metadata python3 -m pytest -q -m gpu tests/test_dsa_metadata.py \
                 tests/test_dsa_metadata.py tests/test_draft_decode_metadata.py tests/test_multi_step.py \
                 tests/test_dsa_backend.py ;;
      bench) step bench_metadata python3 -m dsaspec bench metadata --out "$RESULTS" ;;
      draft) step bench_draft_metadata python3 -m dsaspec bench draft-metadata --out "$RESULTS" ;;
      tune) step tune_metadata python3 scripts/tune_metadata.py --out "$RESULTS" ;;
      sanitize)
        if command -v compute-sanitizer >/dev/null; then
          step sanitizer_metadata compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize_metadata.py
        else
          echo "== sanitize: compute-sanitizer not on PATH, skipped" | tee "$LOGS/sanitizer_metadata.log"
        fi ;;
      ncu)
        if command -v ncu >/dev/null; then
          for variant in "" "--row-align 4 --block-cols 512"; do
            tag=$( [ -z "$variant" ] && echo default || echo aligned_512 )
            # shellcheck disable=SC2086
            step "ncu_bounded_verify_$tag" ncu --clock-control none --section SpeedOfLight \
                --section MemoryWorkloadAnalysis --section Occupancy -k regex:_bounded_kernel -c 1 \
                python3 scripts/profile_metadata.py $variant
          done
        else
          echo "== ncu: ncu not on PATH, skipped" | tee "$LOGS/ncu_bounded_verify.log"
        fi ;;
      *) echo "gpu_metadata.sh: unknown step '$name' (tests, bench, draft, tune, sanitize, ncu)" >&2; exit 2 ;;
    esac
  done
done
exit $status
