#!/usr/bin/env bash
# One lent-GPU session: runs the named steps in order, logs and results under $OUT (default ./gpu_out).
#   bash scripts/gpu_session.sh spec-tests rowinv-bench e2e-quick
# Steps on one GPU: spec-tests, retest, gpu-tests, rowinv-bench, dsa-ops, dsa-sanitize, sanitize, metadata, e2e,
#   e2e-quick, decode, diagnose, draft-step, fp8-tests (-v: failing tests are named as they run),
#   heads-per-rank, fp8-dsa-ops, fp8-dsa-tune, fp8-idx-tune, epilogue-tests (greedy sampling, index RoPE, MLA query, RoPE tables, FP8 indexer, decode inputs, SiLU-and-mul, MoE router),
#   gluon-fp8-sanitize, moe-fp8, moe-split (split-K tests + bench), moe-small-t (the pair layout's GPU tests + bench moe
#   of both layouts; its per-kernel times in the real rank: decode-rank), moe-shared (the GPU tests of the shared expert in
#   the fused MoE; its time: decode-rank), fp8-linear (the FP8 GEMM's split / unsplit forms at the rank shapes),
#   fp8-linear-tiles (the FP8 GEMM with 32- and 64-row tiles: warpgroup MMA from 64, at verify and prefill M),
#   fp8-gemm-tests, fp8-mla-one-split (the FP8 register-path default's tests + dsa-ops), norm-quant (the GPU tests of
#   the norms writing the FP8 GEMMs' codes; their time: decode-rank), mla-query (scripts/bench_mla_query.py: the
#   absorbed query's prefill tiles against cuBLAS on both rank presets), norms (scripts/bench_norms.py: one program a row
#   against 1024-column programs), moe-launches (the router,
#   the pair layout's one-token down tile, the align: their GPU tests; their time: moe-small-t, decode-rank),
#   router-gemm (the router's GPU tests: the FMA tiles, the selection, cuBLAS bf16 from 3 rows + scripts/bench_router_gemm.py), fast-accum (DSASPEC_FP8_FAST_ACCUM:
#   its GPU tests + e2e-rank-glm5 with it), moe-tiles (scripts/bench_moe_tiles.py: sweeps of the fused MoE's
#   gate/up and down tiles at T 1, 2, 4, 32, 128 on the GLM-5 rank; the gate/up's at T 1, 2, 4 took 30 s), moe-align (the sorted layout's tests on the GPU, then its align programs at pair chunks 256-2048
#   and 4 / 8 warps, T 16-512: scripts/sweep_fused_moe.py --align), moe-gpu-tests (the fused MoE's GPU tests), kv-accuracy, e2e-rank-glm5,
#   e2e-rank-glm5-chains (S = 4 and 5), e2e-rank-glm5-real (real acceptance), e2e-rank-v32, decode-rank (bench decode's
#   per-kernel phases on both rank presets), e2e-rank-profile (where the rank preset's graph captures spend their time), moe-tall (bench moe
#   of the GLM-5 rank's experts at 16-, 64- and 128-row blocks, T 512 - 4,096: the prefill tiles), prefill-rank (bench
#   prefill's GPU test, then the GLM-5 FP8 rank's 16k prefill by chunk size and cache dtype), slot-major (sparse MLA's
#   slot-major tiles: their GPU tests, bench dsa-ops at 32 / 16 / 8 heads on both caches, the GLM-5 rank's 16k
#   prefill on FP8 caches with DSASPEC_SPARSE_MLA_SLOT_MAJOR off (the padded Gluon form), on (the default) and
#   with DSASPEC_SPARSE_MLA_GLUON off (the Triton kernel)), slot-major-tune (bench dsa-ops --tune at 8 and 16
#   heads: the slot-major tiles against the padded Gluon form at 16 / 64 decode and 256 verify rows of 64k),
#   slot-major-decode (bench decode of the GLM-5 rank, 8 heads, with DSASPEC_SPARSE_MLA_SLOT_MAJOR off and on), decode-fp8,
#   read-chain (the GLM-5 rank's decode layer as pure-read kernels), read-chain-bench (the bench preset's, 1,056 live
#   as its bench decode: 21 s on an H100), gather-limit (bench dsa-ops' sparse MLA rows with the same slots' gather alone: 64 / 16 / 8 heads,
#   both caches, 64k), fp8-mla-tests-edges-a, -edges-b, -tune, -rest-a, -rest-a96, -rest-a96-split, -rest-a96-split-n32,
#   -rest-a96-split-n64, -rest-b (with
#   fp8-gluon-production: the 533 GPU tests of tests/test_sparse_mla_fp8.py in parts of 105 / 150 / 78 / 72 / 18 /
#   5 / 6 / 7 / 60 / 32; on an H100 with -n 8 edges-b took 218 s, tune 35, gluon-production 260, rest-b 446 + 56 s over
#   two calls, 96 of the 108 production-size tests (-rest-a and the -rest-a96 parts since) 748 s over two, -rest-a96 325 s,
#   8 of the 96-row split tests 250 s), fp8-gluon-production (the FP8 Gluon sparse MLA tests of its named tiles, not the tune
#   candidates, at production sizes and in graph replays: 32), serving (scripts/gpu_serving.sh: carry .whl); pack (last: everything under $OUT into $OUT/out.tgz, since a device
#   call returns at most 8 files). A call's device time is its wall time plus about 60-120 s to start and
#   copy: budget gpu_call.sh's steps for that.
# Steps on two GPUs (nvidia-h200-x2): tp-tests, tp-generate, tp-draft-step, tp-verify-step, tp-e2e-quick, tp-e2e
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
        retest)       python3 -m pytest -q -m gpu -p no:cacheprovider -n 2 tests/test_spec_engine.py tests/test_dsa_metadata.py ;;
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
        tp-tests)     python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m pytest -q -s -m multigpu \
                          -p no:cacheprovider tests/test_tp_model.py tests/test_tp_group.py 2>&1 | tee "$OUT/tp_tests.log" ;;
        tp-generate)  python3 -m dsaspec generate --tp 2 --preset bench --prompt-lens 2100,9,300 --max-new-tokens 32 \
                          --context-len 4096 --speculative-algorithm NEXTN --row-invariant --no-progress 2>&1 \
                          | tee "$OUT/tp_generate.log" ;;
        tp-draft-step) python3 -m dsaspec bench draft-step --tp 2 --rows 1,4,16,32 --iters 100 --out "$OUT" ;;
        tp-verify-step) python3 -m dsaspec bench verify-step --tp 1,2 --iters 100 --out "$OUT" ;;
        tp-e2e-quick) python3 -m dsaspec bench e2e --tp 2 --presets e2e --contexts 1048576 --concurrency 1,4,16,32 \
                          --accept 3.0 --iterations 12 --runs 4 --out "$OUT" ;;
        tp-e2e)       python3 -m dsaspec bench e2e --tp 2 --out "$OUT" ;;
        fp8-tests)    python3 -m pytest -v -p no:cacheprovider -rfE --tb=line -n 8 --timeout 300 tests/test_fused_moe.py \
                          tests/test_fp8_checkpoint.py tests/test_fp8_gemm.py 2>&1 | tee "$OUT/fp8_tests.log" &&
                      python3 -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=line -n 8 --timeout 300 \
                          tests/test_indexer_fp8.py tests/test_sparse_mla_fp8.py tests/test_mla_latent.py \
                          tests/test_index_rope.py tests/test_sparse_mla_gluon.py 2>&1 | tee -a "$OUT/fp8_tests.log" ;;
        heads-per-rank) python3 -m dsaspec bench dsa-ops --ops sparse_mla --modes decode,target_verify --bs 1,16,32,64 \
                          --live-kv 65536 --heads 64,32,16,8 --out "$OUT/heads_per_rank" ;;
        fp8-dsa-ops)  python3 -m dsaspec bench dsa-ops --ops indexer,sparse_mla --modes decode,target_verify \
                          --bs 1,32,64 --live-kv 8192,65536 --kv-cache-dtype fp8_e4m3 --out "$OUT/fp8_glm5" &&
                      python3 -m dsaspec bench dsa-ops --preset deepseek_v32 --ops indexer --modes decode \
                          --bs 1,32,64 --live-kv 8192,65536 --kv-cache-dtype fp8_e4m3 --out "$OUT/fp8_v32" ;;
        fp8-dsa-tune) python3 -m dsaspec bench dsa-ops --tune --ops sparse_mla --kv-cache-dtype fp8_e4m3 --out "$OUT/fp8_tune" ;;
        fp8-idx-tune) python3 -m dsaspec bench dsa-ops --tune --ops indexer --modes decode --bs 1,16,32,64 \
                          --live-kv 8192,65536 --kv-cache-dtype fp8_e4m3 --iters 50 --out "$OUT/fp8_idx_tune" ;;
        epilogue-tests) python3 -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short -n 4 --timeout 300 \
                          tests/test_greedy_tokens.py tests/test_index_rope.py tests/test_mla_latent.py \
                          tests/test_rope_cos_sin.py tests/test_indexer_fp8.py tests/test_decode_inputs.py \
                          tests/test_silu_and_mul.py tests/test_moe_router.py \
                          tests/test_engine.py::test_gpu_graph_decode_matches_eager_decode \
                          tests/test_spec_engine.py::test_gpu_speculative_equals_plain_row_invariant \
                          2>&1 | tee "$OUT/epilogue_tests.log" ;;
        moe-fp8)      python3 -m dsaspec bench moe --weight-dtype bf16,fp8 --intermediate 256,2048 --out "$OUT" ;;
        moe-split)    python3 -m pytest -v -rfE -p no:cacheprovider tests/test_fused_moe.py -k split_k 2>&1 \
                          | tee "$OUT/moe_split_tests.log" &&
                      python3 -m dsaspec bench moe --weight-dtype bf16,fp8 --intermediate 256 --tokens 1,2,4,8,16 \
                          --split-k 1,2,4,7 --out "$OUT/moe_split" ;;
        moe-small-t)  python3 -m pytest -v -m gpu -rfE -p no:cacheprovider --timeout 900 tests/test_fused_moe.py \
                          -k "pair_layout or row_invariant or graph_replay or production" 2>&1 \
                          | tee "$OUT/moe_small_t_tests.log" &&
                      python3 -m dsaspec bench moe --weight-dtype bf16,fp8 --intermediate 256 --tokens 1,2,4,8,16 \
                          --split-k 1,4 --layout sorted,pairs --out "$OUT/moe_small_t" ;;
        moe-shared)   python3 -m pytest -v -m gpu -rfE -p no:cacheprovider --timeout 600 tests/test_moe_shared_experts.py \
                          tests/test_moe_router.py tests/test_fused_moe.py tests/test_fp8_checkpoint.py 2>&1 \
                          | tee "$OUT/moe_shared_tests.log" ;;
        gluon-fp8-sanitize) for tool in memcheck racecheck; do
                          compute-sanitizer --tool $tool --error-exitcode 1 python3 -m pytest -q -p no:cacheprovider \
                              "tests/test_sparse_mla_fp8.py::test_gpu_gluon_edge_counts_holes_and_poison[64-None-gluon_fp8]" \
                              "tests/test_sparse_mla_fp8.py::test_gpu_gluon_edge_counts_holes_and_poison[16-3-gluon_fp8_narrow]" \
                              > "$OUT/${tool}_gluon_fp8.log" 2>&1; tail -3 "$OUT/${tool}_gluon_fp8.log"
                      done ;;
        fp8-linear)   python3 scripts/bench_fp8_linear.py "$OUT/fp8_linear" --preset deepseek-v32-fp8-tp8-rank \
                          --programs-per-sm 2,4,8 &&
                      python3 scripts/bench_fp8_linear.py "$OUT/fp8_linear" --preset glm5-fp8-tp8-rank --programs-per-sm 2,4,8 ;;
        fp8-linear-tiles) python3 scripts/bench_fp8_linear.py "$OUT/fp8_linear_tiles" --preset glm5-fp8-tp8-rank \
                          --rows 1,16,64,128,256,1024 --block-m 32,64 ;;
        router-gemm)  python3 -m pytest -v -p no:cacheprovider -rfE --tb=short -n 4 --timeout 300 \
                          tests/test_router_logits.py tests/test_moe_router.py 2>&1 | tee "$OUT/router_gemm_tests.log";
                      python3 scripts/bench_router_gemm.py "$OUT/router_gemm" ;;
        moe-tiles)    python3 scripts/bench_moe_tiles.py "$OUT/moe_tiles" ;;
        moe-align)    python3 -m pytest -v -p no:cacheprovider -rfE --tb=short -n 4 --timeout 400 tests/test_fused_moe.py \
                          -k "stable_padded_sort or matches_reference or routing_extremes or repeated_ids" 2>&1 \
                          | tee "$OUT/moe_align_tests.log" &&
                      python3 scripts/sweep_fused_moe.py "$OUT/moe_align" --tokens 16,32,64,128,512 --weight-dtype fp8 \
                          --align 1024x4,512x4,256x4,2048x4,1024x8 ;;
        moe-gpu-tests) python3 -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short -n 4 --timeout 400 \
                          tests/test_fused_moe.py tests/test_moe_shared_experts.py 2>&1 | tee "$OUT/moe_gpu_tests.log" ;;
        fast-accum)   python3 -m pytest -v -p no:cacheprovider -rfE --tb=short -n 4 --timeout 300 tests/test_fp8_gemm.py \
                          -k "fast_accum or fp8_gemm_production" 2>&1 | tee "$OUT/fast_accum_tests.log";
                      DSASPEC_FP8_FAST_ACCUM=1 python3 -m dsaspec bench e2e --presets glm5-fp8-tp8-rank --num-steps 3 \
                          --contexts 1048576 --concurrency 1,8,32 --accept 3.0 --out "$OUT/rank_glm5_fast_accum" ;;
        fp8-gemm-tests) python3 -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short -n 4 --timeout 300 \
                          tests/test_fp8_gemm.py tests/test_fp8_checkpoint.py tests/test_model.py 2>&1 \
                          | tee "$OUT/fp8_gemm_tests.log" ;;
        fp8-mla-one-split) python3 -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short -n 8 --timeout 300 \
                          tests/test_sparse_mla_fp8.py -k "one_split or bf16_gluon_kernel or (production_sizes and default) \
                          or (cuda_graph_replay and default)" 2>&1 | tee "$OUT/fp8_mla_one_split_tests.log" &&
                      python3 -m dsaspec bench dsa-ops --ops sparse_mla --kv-cache-dtype fp8_e4m3 --modes decode,target_verify \
                          --bs 1,16,32,64 --live-kv 8192,65536 --out "$OUT/fp8_one_split" ;;
        norms)        python3 scripts/bench_norms.py "$OUT/norms" ;;
        mla-query)    tiles=64x128x4x3,64x64x4x3,128x64x4x3,128x128x8x3
                      python3 scripts/bench_mla_query.py "$OUT/mla_query" --preset glm5-fp8-tp8-rank --tiles $tiles &&
                      python3 scripts/bench_mla_query.py "$OUT/mla_query" --preset deepseek-v32-fp8-tp8-rank --tiles $tiles ;;
        norm-quant)   python3 -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short --timeout 600 -k norm_quant \
                          tests/test_row_invariant.py tests/test_model.py 2>&1 | tee "$OUT/norm_quant_tests.log" ;;
        moe-launches) python3 -m pytest -v -p no:cacheprovider -rfE --tb=short -n 4 --timeout 400 \
                          tests/test_row_invariant.py tests/test_fused_moe.py -k "linear or stable_padded_sort or \
                          out_of_range or (matches_reference and not fp8)" 2>&1 | tee "$OUT/moe_launches_tests.log" &&
                      python3 -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short -n 4 --timeout 400 \
                          tests/test_moe_router.py tests/test_fused_moe.py -k "router or pair_layout" 2>&1 \
                          | tee -a "$OUT/moe_launches_tests.log" ;;
        kv-accuracy)  python3 -m dsaspec bench kv-accuracy --out "$OUT" ;;
        serving)      OUT=$OUT bash scripts/gpu_serving.sh ;;
        e2e-rank-glm5) python3 -m dsaspec bench e2e --presets glm5-fp8-tp8-rank --num-steps 3 --contexts 1048576 \
                          --concurrency 1,8,32 --accept 3.0 --out "$OUT/rank_glm5" ;;
        e2e-rank-profile) TRITON_CACHE_DIR="$OUT/triton_cache" python3 -m cProfile -o "$OUT/rank_capture.prof" \
                          -m dsaspec bench e2e --presets glm5-fp8-tp8-rank --num-steps 3 --contexts 1048576 \
                          --concurrency 1 --accept 3.0 --iterations 4 --runs 1 --out "$OUT/rank_glm5_c1" 2>&1 \
                          | tr '\r' '\n' | grep -v 'random weights: .*%' > "$OUT/rank_profile.log"
                      echo "Triton kernels compiled: $(find "$OUT/triton_cache" -name '*.cubin' | wc -l)" \
                          | tee -a "$OUT/rank_profile.log"
                      rm -rf "$OUT/triton_cache"
                      python3 -c "import pstats; s = pstats.Stats('$OUT/rank_capture.prof'); \
                          s.sort_stats('tottime').print_stats(40); s.sort_stats('cumulative').print_stats(60)" \
                          >> "$OUT/rank_profile.log" ;;
        e2e-rank-glm5-chains) python3 -m dsaspec bench e2e --presets glm5-fp8-tp8-rank --num-steps 4,5 \
                          --contexts 1048576 --concurrency 1,8,32 --accept 3.0 --out "$OUT/rank_glm5_chains" ;;
        e2e-rank-v32) python3 -m dsaspec bench e2e --presets deepseek-v32-fp8-tp8-rank --num-steps 3 --contexts 1048576 \
                          --concurrency 1,8,32 --accept 3.0 --out "$OUT/rank_v32" ;;
        decode-rank)  python3 -m dsaspec bench decode --preset glm5-fp8-tp8-rank --bs 1,4,32 --contexts 1048576 \
                          --runs 2 --steps 16 --out "$OUT/decode_rank_glm5" &&
                      python3 -m dsaspec bench decode --preset deepseek-v32-fp8-tp8-rank --bs 1,4,32 --contexts 1048576 \
                          --runs 2 --steps 16 --out "$OUT/decode_rank_v32" ;;
        e2e-rank-glm5-real) python3 -m dsaspec bench e2e --presets glm5-fp8-tp8-rank --num-steps 3 --contexts 1048576 \
                          --concurrency 1,8,32 --accept real --out "$OUT/rank_glm5_real" ;;
        moe-tall)     python3 -m dsaspec bench moe --tokens 512,1024,4096 --experts 256 --topk 8 --shared-experts 1 \
                          --hidden 6144 --intermediate 256 --weight-dtype fp8 --block-m 16,64,128 --out "$OUT/moe_tall" ;;
        prefill-rank) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_bench_prefill.py \
                          > "$OUT/prefill_gpu_test.log" 2>&1; python3 -m dsaspec bench prefill \
                          --preset glm5-fp8-tp8-rank --prompt-len 16384 --chunk-sizes 512,4096 \
                          --kv-cache-dtype bf16,fp8_e4m3 --out "$OUT/prefill" ;;
        slot-major)   python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 --timeout 180 tests/test_sparse_mla.py \
                          tests/test_sparse_mla_fp8.py -k "slot_major" > "$OUT/slot_major_gpu_tests.log" 2>&1
                      tail -3 "$OUT/slot_major_gpu_tests.log"
                      timeout 240 python3 -m dsaspec bench dsa-ops --ops sparse_mla --modes decode,target_verify --bs 1,16,64 \
                          --live-kv 65536 --heads 32,16,8 --kv-cache-dtype fp8_e4m3 --out "$OUT/slot_major_dsa_ops"
                      for run in "0 1" "1 1" "1 0"; do read -r slot_major gluon <<< "$run"
                          DSASPEC_SPARSE_MLA_SLOT_MAJOR=$slot_major DSASPEC_SPARSE_MLA_GLUON=$gluon timeout 300 python3 -m dsaspec \
                          bench prefill --preset glm5-fp8-tp8-rank --prompt-len 16384 --chunk-sizes 4096 \
                          --kv-cache-dtype fp8_e4m3 --out "$OUT/slot_major_prefill_${slot_major}${gluon}"; done ;;
        slot-major-tune) timeout 420 python3 -m dsaspec bench dsa-ops --tune --ops sparse_mla --heads 8,16 --modes decode,target_verify \
                          --bs 16,64 --live-kv 65536 --kv-cache-dtype fp8_e4m3 --out "$OUT/slot_major_tune" ;;
        slot-major-decode) for slot_major in 0 1; do DSASPEC_SPARSE_MLA_SLOT_MAJOR=$slot_major timeout 300 python3 -m dsaspec \
                          bench decode --preset glm5-fp8-tp8-rank --bs 1,4,32 --contexts 1048576 --runs 2 --steps 16 \
                          --out "$OUT/slot_major_decode_rank_$slot_major"; done ;;
        decode-fp8)   python3 -m dsaspec bench decode --live 65536 --bs 1,4,16,32,48,64 --contexts 1048576 --runs 2 \
                          --kv-cache-dtype bf16,fp8_e4m3 --out "$OUT/decode_fp8" ;;
        read-chain)   python3 scripts/bench_read_chain.py "$OUT/read_chain" --iters 50 ;;
        read-chain-bench) python3 scripts/bench_read_chain.py "$OUT/read_chain" --preset bench --live 1056 \
                          --tokens 1,4,16,32 --iters 50 ;;
        gather-limit) python3 -m dsaspec bench dsa-ops --ops sparse_mla --modes decode,target_verify --bs 1,16,64 \
                          --live-kv 65536 --heads 64,16,8 --kv-cache-dtype fp8_e4m3 --out "$OUT/gather_limit" ;;
        fp8-gluon-production) python3 -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short -n 8 --timeout 300 \
                          tests/test_sparse_mla_fp8.py -k "gluon and (production_sizes or cuda_graph_replay) and not tune" \
                          2>&1 | tee "$OUT/fp8_gluon_production_tests.log" ;;
        fp8-mla-tests-edges-a|fp8-mla-tests-edges-b|fp8-mla-tests-tune|fp8-mla-tests-rest-a|fp8-mla-tests-rest-a96|fp8-mla-tests-rest-a96-split|fp8-mla-tests-rest-a96-split-n32|\
        fp8-mla-tests-rest-a96-split-n64|fp8-mla-tests-rest-b)
                      rest="not edge_counts and not tune_candidates and not (gluon and (production_sizes or cuda_graph_replay) and not tune)"
                      case $step in
                          *-edges-a) select="edge_counts and n64" ;;
                          *-edges-b) select="edge_counts and not n64" ;;
                          *-tune) select="tune_candidates" ;;
                          *-rest-a) select="$rest and production_sizes and not [96-" ;;
                          *-rest-a96) select="$rest and production_sizes and [96-False-" ;;
                          *-rest-a96-split) select="$rest and production_sizes and [96-True- and not tune" ;;
                          *-rest-a96-split-n32) select="$rest and production_sizes and [96-True-gluon_fp8_tune_n32" ;;
                          *-rest-a96-split-n64) select="$rest and production_sizes and [96-True-gluon_fp8_tune_n64" ;;
                          *) select="$rest and not production_sizes" ;;
                      esac
                      python3 -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short -n 8 --timeout 300 \
                          tests/test_sparse_mla_fp8.py -k "$select" 2>&1 | tee "$OUT/$step.log" ;;
        small-m-ncu)  ncu --clock-control none --target-processes all \
                          -k regex:'_gate_up_kernel|_down_kernel|_fp8_gemm_kernel' --launch-skip 5 --launch-count 5 \
                          --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
                          --section SchedulerStats --section Occupancy --section LaunchStats --section SourceCounters \
                          --print-details all python3 scripts/small_m_kernels.py > "$OUT/ncu_small_m.txt" 2>&1 ;;
        pack)         (cd "$OUT" && tar -czf /tmp/out.tgz --exclude=out.tgz . && find . -mindepth 1 -delete \
                          && mv /tmp/out.tgz out.tgz) ;;
        *) echo "unknown step $step"; status=2; continue ;;
    esac
    rc=${PIPESTATUS[0]}  # the step's command, not the tee after it
    echo "== $step exit $rc $(date +%T)"
    [ "$rc" -ne 0 ] && status=1
done
exit $status
