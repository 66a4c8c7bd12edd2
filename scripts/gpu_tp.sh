#!/usr/bin/env bash
# Tensor parallel on two GPUs (nvidia-h200-x2): runs the named steps in order, logs and results under
# $OUT (default ./gpu_out). Default: tp-tests tp-generate tp-draft-step tp-e2e-quick.
#   bash scripts/gpu_tp.sh tp-tests tp-e2e
# Steps: tp-tests, tp-generate, tp-draft-step, tp-verify-step, tp-e2e-quick, tp-e2e
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tp-tests tp-generate tp-draft-step tp-e2e-quick)
status=0
for step in "${steps[@]}"; do
    echo "== $step $(date +%T)"
    case $step in
        tp-tests)      python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m pytest -q -s -m multigpu \
                           -p no:cacheprovider tests/test_tp_model.py tests/test_tp_group.py 2>&1 | tee "$OUT/tp_tests.log" ;;
        tp-generate)   python3 -m dsaspec generate --tp 2 --preset bench --prompt-lens 2100,9,300 --max-new-tokens 32 --context-len 4096 \
                           --speculative-algorithm NEXTN --row-invariant --no-progress 2>&1 | tee "$OUT/tp_generate.log" ;;
        tp-draft-step) python3 -m dsaspec bench draft-step --tp 2 --rows 1,4,16,32 --iters 100 --out "$OUT" ;;
        tp-verify-step) python3 -m dsaspec bench verify-step --tp 1,2 --iters 100 --out "$OUT" ;;
        tp-e2e-quick)  python3 -m dsaspec bench e2e --tp 2 --presets e2e --contexts 1048576 --concurrency 1,4,16,32 \
                           --accept 3.0 --iterations 12 --runs 4 --out "$OUT" ;;
        tp-e2e)        python3 -m dsaspec bench e2e --tp 2 --out "$OUT" ;;
        *) echo "unknown step $step"; status=2; continue ;;
    esac
    rc=${PIPESTATUS[0]}
    echo "== $step exit $rc $(date +%T)"
    [ "$rc" -ne 0 ] && status=1
done
exit $status
