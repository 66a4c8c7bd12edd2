#!/usr/bin/env bash
# The DSA decode ops on a GPU (docs/dsa-kernels.md): gpu-marked tests, compute-sanitizer memcheck,
# `dsaspec bench dsa-ops`, and its --tune sweep. Each stage fits in a 10-minute device call:
#
#   scripts/gpu_dsa_ops.sh [tests|sanitize|bench|tune|all]   (default: all)
#
# Results (dsa_ops*.{json,md}) and logs (logs/*.log) go to $OUT when set, else to
# benchmarks/results/<machine>/. The exit status is non-zero when a stage failed.
# Without CUDA the tests skip and the benchmark only checks outputs at small sizes.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's dsaspec, whatever is installed

stage="${1:-all}"
case "$stage" in tests|sanitize|bench|tune|all) ;; *)
  echo "gpu_dsa_ops.sh: unknown stage '$stage'; expected tests, sanitize, bench, tune or all" >&2
  exit 2 ;;
esac
if [ -n "${OUT:-}" ]; then
  results="$OUT"
else
  results="benchmarks/results/$(python3 -c 'from dsaspec.bench.results import default_machine_dir as d; print(d())')"
fi
logs="$results/logs"
mkdir -p "$logs"
status=0

run() {  # run NAME CMD...: CMD's output to the terminal and to $logs/NAME.log
  local name=$1
  shift
  echo "== $name: $*"
  "$@" 2>&1 | tee "$logs/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc"
  [ "$rc" -eq 0 ] || status=1
}

if [ "$stage" = tests ] || [ "$stage" = all ]; then
  run gpu_tests_dsa_ops python3 -m pytest -q -m gpu tests/test_indexer_schedule.py \
    tests/test_indexer.py tests/test_topk.py tests/test_sparse_mla.py
fi

if [ "$stage" = sanitize ] || [ "$stage" = all ]; then
  # every kernel once at a moderate size: skipped and long rows, split and single pass
  cat > "$logs/sanitize_dsa_ops.py" <<'EOF'
import torch

from dsaspec.ops.indexer import INDEXER_BASELINE_CONFIG, INDEXER_CONFIG, indexer_logits
from dsaspec.ops.indexer_schedule import indexer_schedule
from dsaspec.ops.sparse_mla import SPARSE_MLA_BASELINE_CONFIG, SPARSE_MLA_CONFIG, SPARSE_MLA_GLUON_CONFIG, sparse_mla_decode, sparse_mla_workspace
from dsaspec.ops.sparse_mla_gluon import sparse_mla_gluon_supported
from dsaspec.ops.topk import topk_candidates, topk_slots, topk_workspace

dev, k, heads, width, num_slots = torch.device("cuda"), 2048, 64, 9000, 20000
seqlens = torch.tensor([1, 2048, 2049, 9000, 100, 4097], dtype=torch.int32, device=dev)
rows = seqlens.numel()
table = torch.randint(0, num_slots, (rows, width), dtype=torch.int32, device=dev)
q_index = torch.randn(rows, 32, 128, device=dev).bfloat16()
weights = torch.randn(rows, 32, device=dev)
index_k = torch.randn(num_slots, 128, device=dev).bfloat16()
sms = torch.cuda.get_device_properties(dev).multi_processor_count
schedule = torch.zeros(sms + 1, 2, dtype=torch.int32, device=dev)
logits = torch.zeros(rows, width, device=dev)
for skip, config in ((k, INDEXER_CONFIG), (0, INDEXER_BASELINE_CONFIG)):
    indexer_schedule(seqlens, sms, schedule, skip_len=skip)
    indexer_logits(q_index, weights, index_k, table, seqlens, schedule, logits, skip_len=skip, config=config)
# row groups (target verify): two groups of 3 rows read their first row's page table; a group of
# 3 leaves a padding member in the dot's columns
group_lens = torch.tensor([100, 101, 102, 8998, 8999, 9000], dtype=torch.int32, device=dev)
indexer_schedule(group_lens, sms, schedule, rows_per_group=3)
indexer_logits(q_index, weights, index_k, table, group_lens, schedule, torch.zeros_like(logits),
               rows_per_group=3, check_values=False)
slots = torch.zeros(rows, k, dtype=torch.int32, device=dev)
positions = torch.zeros_like(slots)
topk_slots(logits, seqlens, table, k, slots, out_positions=positions)
topk_slots(logits, seqlens, table, k, slots, baseline_read_short_rows=True)
for chunks in (None, 7):  # the chunked form: the default chunk count, and an odd one
    topk_slots(logits, seqlens, table, k, slots, out_positions=positions,
               workspace=topk_workspace(rows, dev, num_chunks=chunks))
# one program per row with candidate lists: listed, too few listed (the sample misleads), too many
long = torch.randn(3, 20000, device=dev)
long[1, ::32] += 100.0
long[2] = 0.5
long_slots = torch.zeros(3, k, dtype=torch.int32, device=dev)
topk_slots(long, torch.tensor([20000, 19999, 20000], dtype=torch.int32, device=dev),
           torch.randint(0, num_slots, (3, 20000), dtype=torch.int32, device=dev), k, long_slots,
           out_positions=torch.zeros_like(long_slots), candidates=topk_candidates(3, k, dev))
# the chunked form with lists per chunk (one kernel, and six launches): the same three rows in 3
# chunks, long enough for lists (topk_sampled_min_live(k, dev, num_chunks=3) = 14336)
for single in (True, False):
    topk_slots(long, torch.tensor([20000, 19999, 20000], dtype=torch.int32, device=dev),
               torch.randint(0, num_slots, (3, 20000), dtype=torch.int32, device=dev), k, long_slots,
               out_positions=torch.zeros_like(long_slots), workspace=topk_workspace(3, dev, num_chunks=3),
               single_launch=single, candidates=topk_candidates(3, k, dev, num_chunks=3))
q = torch.randn(rows, heads, 576, device=dev).bfloat16()
cache = torch.randn(num_slots, 576, device=dev).bfloat16()
out = torch.zeros(rows, heads, 512, dtype=torch.bfloat16, device=dev)
sparse_mla_configs = [SPARSE_MLA_CONFIG, SPARSE_MLA_BASELINE_CONFIG]
if sparse_mla_gluon_supported(dev, heads):  # the Gluon kernel (Hopper)
    sparse_mla_configs.append(SPARSE_MLA_GLUON_CONFIG)
for config in sparse_mla_configs:
    sparse_mla_decode(q, cache, slots, 0.06, out, config=config)
    sparse_mla_decode(q, cache, slots, 0.06, out, config=config,
                      workspace=sparse_mla_workspace(rows, heads, dev, num_splits=5, config=config))
# one row: the few-rows configuration, and the combine's two column blocks per head
sparse_mla_decode(q[1:2], cache, slots[1:2], 0.06, out[1:2],
                  workspace=sparse_mla_workspace(1, heads, dev))
torch.cuda.synchronize()
print("sanitize_dsa_ops: all kernels ran")
EOF
  if command -v compute-sanitizer > /dev/null; then
    run sanitizer_dsa_ops compute-sanitizer --tool memcheck --error-exitcode 1 \
      python3 "$logs/sanitize_dsa_ops.py"
  else
    echo "== sanitize: compute-sanitizer not found; running the kernels without it"
    run sanitizer_dsa_ops python3 "$logs/sanitize_dsa_ops.py"
  fi
fi

if [ "$stage" = bench ] || [ "$stage" = all ]; then
  run bench_dsa_ops python3 -m dsaspec bench dsa-ops --out "$results"
fi

if [ "$stage" = tune ] || [ "$stage" = all ]; then
  run bench_dsa_ops_tune python3 -m dsaspec bench dsa-ops --tune --out "$results"
fi
exit $status
