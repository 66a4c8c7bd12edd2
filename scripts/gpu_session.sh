#!/usr/bin/env bash
# One lent-GPU session: runs the named steps in order, logs and results under $OUT (default ./gpu_out).
#   bash scripts/gpu_session.sh spec-tests rowinv-bench e2e-quick
# Steps: spec-tests, retest, gpu-tests, rowinv-bench, dsa-ops, dsa-sanitize, sanitize, metadata, e2e, e2e-quick, decode, diagnose, draft-step
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
status=0
for step in "$@"; do
    echo "== $step $(date +%T)"
    case $step in
        spec-tests)   python3 -m pytest -q -m gpu -p no:cacheprovider -n 2 tests/test_spec_engine.py tests/test_row_invariant.py ;;
        retest)       python3 -m pytest -q -m gpu -p no:cacheprovider -n 2 tests/test_spec_engine.py tests/test_dsa_metadata_bounded.py ;;
        gpu-tests)    python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 --dist loadfile --timeout 420 tests ;;
        rowinv-bench) python3 scripts/bench_row_invariant.py --out "$OUT/row_invariant.json" ;;
        dsa-ops)      python3 -m dsaspec bench dsa-ops --out "$OUT" ;;
        metadata)     python3 -m dsaspec bench metadata --iters 100 --out "$OUT"; python3 -m dsaspec bench draft-metadata --iters 100 --out "$OUT" ;;
        e2e)          python3 -m dsaspec bench e2e --out "$OUT" ;;
        e2e-quick)    python3 -m dsaspec bench e2e --presets e2e --contexts 1048576,4096 --concurrency 1,8,32 \
                          --iterations 8 --runs 2 --accept 3.0 --out "$OUT" ;;
        decode)       python3 -m dsaspec bench decode --out "$OUT" ;;
        diagnose)     python3 scripts/diagnose_spec_identity.py --out "$OUT/spec_identity.md" ;;
        dsa-sanitize) bash scripts/gpu_dsa_ops.sh sanitize ;;
        sanitize)     compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize_metadata.py \
                          > "$OUT/sanitizer_metadata.log" 2>&1; tail -3 "$OUT/sanitizer_metadata.log"
                      compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize_row_invariant.py \
                          > "$OUT/sanitizer_row_invariant.log" 2>&1; tail -3 "$OUT/sanitizer_row_invariant.log"
                      compute-sanitizer --tool racecheck --error-exitcode 1 python3 scripts/sanitize_row_invariant.py \
                          > "$OUT/racecheck_row_invariant.log" 2>&1; tail -3 "$OUT/racecheck_row_invariant.log" ;;
        draft-step)   python3 -m dsaspec bench draft-step --out "$OUT" ;;
        *) echo "unknown step $step"; status=2; continue ;;
    esac
    rc=$?
    echo "== $step exit $rc $(date +%T)"
    [ $rc -ne 0 ] && status=1
done
exit $status
