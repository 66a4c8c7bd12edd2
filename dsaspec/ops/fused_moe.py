"""Fused MoE: routed experts with SiLU-gated MLPs, for decode / verify sizes and prefill chunks.

``out[t] = sum_j topk_weights[t, j] * (w2[e] @ (silu(w13[e, :I] @ x) * (w13[e, I:] @ x)))`` with
``x = hidden[t]`` and ``e = topk_ids[t, j]``, with no host sync (CUDA-graph safe with a workspace
from :func:`fused_moe_workspace`). The GEMMs work on blocks of ``M = block_m`` rows (16, or for
prefill-sized calls 64 or 128: :func:`moe_block_m`), each holding pairs ``p = t * k + j`` of one
expert, the ranks ``[M q, M q + M)`` of its pairs in ascending ``p``, padding rows -1. Two layouts
place these blocks, chosen by ``P = T * k`` alone (:func:`sorts_pairs`; tall blocks always sort);
the sorted layout, four launches:

1. align (a program per expert): the P pairs are sorted by expert, stably, into segments padded
   to ``M`` rows; each block is mapped to its expert, blocks past the last segment to -1.
   Program e ranks expert e's pairs in pair order (a running count over the ids) and counts them;
   the last program to finish, told by an atomic counter that it resets to 0 (the device's
   split-K tile counters, as gate/up's), places every pair at its expert's first row (the
   segments' running sum) plus its rank and spreads each segment's expert over its blocks (a
   running max from the segment's first block). The
   grid of the GEMMs is the static bound ``(P + min(E, P) * (M - 1)) // M`` blocks;
   programs of unused blocks return at once.
2. gate/up: one grouped GEMM launch; a program takes one block and ``BLOCK_N`` columns of both the
   gate and the up rows of its expert, accumulates both in fp32 and writes ``silu(gate) * up``
   rounded to the hidden dtype (the one intermediate rounding). With ``split_k = S > 1``: S
   programs per tile, split ``s`` over the K blocks ``[s * ceil(nk / S), (s + 1) * ceil(nk / S))``
   of the ``nk = ceil(H / BLOCK_K)``, each writing its fp32 gate and up sums to row ``s`` of an
   ``[S, rows, 2I]`` workspace buffer. The last program of a block's reduction group (FP8: 128
   columns, the activation's scale block; else its tile) to finish, told by an atomic counter per
   block and group that it resets to 0 (the device's split-K tile counters of
   :mod:`~dsaspec.ops.row_invariant`: zeroed on the first split call, which must come before any
   CUDA-graph capture), adds the group's S partials in order s = 0..S-1 in fp32 and
   writes ``silu(gate) * up`` rounded once: the order of arrival picks who sums, never the order of
   the sum, and no launch is added. This is for small I, where one split leaves the SMs idle behind
   long serial K loops.
3. down: one grouped GEMM launch, fp32 accumulation, the pair's routing weight multiplied in fp32,
   written as fp32 to the pair's row ``p`` of a ``[P, H]`` partial buffer.
4. combine: ``out[t] = sum_{j = 0..k-1} partial[t * k + j]`` in that order, fp32, one cast.

The pair layout (P <= :data:`PAIR_LAYOUT_MAX_PAIRS`, 16-row blocks only), two launches, no align and no
combine:

1. gate/up: P blocks, block ``b`` pair ``b``'s. Each program reads the P ids: where ``b``'s rank ``r``
   among its expert's pairs is a multiple of ``BLOCK_M`` (always, for an expert of at most 16
   pairs, at its first one) the block holds that expert's ranks ``[r, r + BLOCK_M)``, the sorted
   layout's block, else the program returns. The activation of pair ``p`` goes to row ``p`` (split
   partials likewise, the counters indexed by ``b``).
2. down: one program per token and ``BLOCK_N`` columns runs the token's k pairs in order j, each
   the sorted layout's tile product (its activation row in a tile of the same shape) times its
   weight, added to an fp32 sum, cast once and written to ``out``: the combine folded in, no
   partial buffer. An expert picked by n tokens is read n times here, once by the sorted down.

Tall blocks (``block_m`` 64 / 128, from ``PREFILL_MIN_ROWS`` tokens by :func:`moe_block_m`): at
thousands of tokens an expert holds hundreds of pairs, and 16-row blocks read its weights once per 16 of
them (and FP8 16-row dots run HMMA on widened codes); from 64 rows a block's FP8 dots take the e4m3
warpgroup MMA and its weights are read a quarter (or an eighth) as often. Their tiles
(:data:`_TALL_TILES`) are sized for many programs, not from the SM count.

Row invariance, for ``block_m = 16`` (every call below ``PREFILL_MIN_ROWS`` tokens: every decode
and verify graph). Tall blocks change a token's bits as a function of T: the e4m3 warpgroup MMA sums
each 128-column K block with fewer bits than fp32, and which block height a call takes depends on T.
The runtime never runs the fused MoE in its row-invariant mode (:func:`~dsaspec.layers.moe.set_fused_moe`)
anyway. At 16 rows: the tiles and warps are chosen from ``(N, K, k, dtype, device)`` and the layout
(the pair layout's down has one program per token where the sorted one has k, so its tile is sized
for one program per token: FP8 ``BLOCK_N`` 32 instead of 128 at H 6144 on 132 SMs), never from T; a row of a tile
meets the weight tile in a ``tl.dot`` (each output element from its own row and column, over the
same K blocks in the same order whatever ``BLOCK_N``), K blocks are accumulated in order, the
split partials are added in order and the combine order is fixed. ``split_k`` changes the
summation order, so it must be fixed per shape (E, k, H, I, dtype), never chosen from T: then the
invariance holds at every split. The two layouts do the same fp32 operations in the same order on
the same blocks (the down kernel compiles without FMA contraction, so the pair layout's ``sum +
acc * w`` rounds the product as the stored partial is rounded), so the layout changes no bit
either. A token's output bits depend only on its own hidden row, ids and weights: not on T, on the
other tokens, or on where its pairs land. The result is deterministic (at every ``block_m``).

FP8 block-scaled experts (``w13`` / ``w2`` e4m3 with fp32 ``weight_scale_inv`` per 128 x 128 block
of each expert's projection, the official checkpoints' format, :mod:`dsaspec.ops.fp8_gemm`): the
same launches with a constexpr ``FP8`` switch in the two GEMM kernels, plus
:func:`~dsaspec.ops.fp8_gemm.act_quant` launches per token per 128 columns: the hidden rows before
gate/up (unless the norm before wrote them: ``hidden_codes``) and, with one gate/up split, the
activations before down (with ``split_k > 1`` the program that reduces a group quantizes its rows'
128 columns as it stores them, with act_quant's math). Each 128-column
K block is one e4m3 ``tl.dot`` with fp32 accumulation, scaled by ``a_scale[row, kb] *
w_scale[expert, n // 128, kb]`` and added in fp32 in K order, as
:func:`~dsaspec.ops.fp8_gemm.fp8_gemm` does. Row invariance holds as above (the quantization is
per row).

Shared experts: the MoE layer passes its shared expert as one more expert (``E + 1`` of them,
:meth:`~dsaspec.layers.moe.MoE.fuse_shared_experts`) and one more slot per token, id ``E`` at
weight 1.0, written by the router's kernel (``route_topk``'s ``n_shared``). Nothing here changes:
its T pairs fill ``ceil(T / M)`` blocks, the grids and the workspace follow ``(T * (k + 1), E + 1)``,
and the combine (or the pair layout's down) adds its product after the k routed ones, in fp32,
before the one cast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsaspec.forward_mode import PREFILL_MIN_ROWS
from dsaspec.ops.checks import check_count, check_tensor
from dsaspec.ops.device import enter_chain, last_to_arrive, sm_count, supports_pdl, tile_counters, wait_in_chain
from dsaspec.ops.e4m3 import quantize_rows
from dsaspec.ops.fp8_gemm import BLOCK as FP8_BLOCK, SCALE_FORMATS, act_quant

BLOCK_M = 16  # rows of a grouped-GEMM tile by default: the padding unit of an expert's segment
BLOCK_MS = (16, 64, 128)  # the row-block heights fused_moe accepts (block_m)
# moe_block_m's rule: 16-row blocks below PREFILL_MIN_ROWS tokens (every decode / verify graph, so
# those stay row-invariant), TALL_BLOCK_M rows from there (prefill chunks). On the GLM-5 FP8 rank's experts
# (H 6144, I 256, 256 routed + the shared one, k 8; H200, CUDA graphs) 16 / 64 / 128 rows took 506 / 507 /
# 777 us at T 512, 794 / 632 / 871 at 1,024 and 2,679 / 1,480 / 1,724 at 4,096
# (benchmarks/results/h200/logs/moe_tall_blocks_glm5_rank_session22.md).
TALL_BLOCK_M = 64
_DTYPES = (torch.bfloat16, torch.float32)
FP8 = torch.float8_e4m3fn
# the align programs' chunks: the pairs one program ranks (its expert's) or places (the last) at a
# time, the blocks its running max spreads the experts over at a time; warps per program. 4 warps:
# 4.7 - 13.4 µs at T 16 - 512 (GLM-5 rank, 8 pairs a token); 8 warps 4.3 - 13.0 but the sm_90
# compile spills 4 bytes at 9 experts; pair chunks of 256 / 512 lose from T 64, 2048 wins only at
# T 512 (benchmarks/results/h200/logs/moe_align_sweep_session14.json)
_ALIGN_PAIR_CHUNK, _ALIGN_BLOCK_CHUNK = 1024, 1024
_ALIGN_WARPS = 4
_STAGE_BYTES = 160 * 1024  # shared memory of a GEMM's pipeline stages (the H200 has 227 KB)
_COMBINE_ELEMENTS = 1024  # outputs per combine program


# FP8 experts of I <= 256 (a TP 8 rank of GLM-5 / DeepSeek-V3.2): gate/up in 2 K splits of 32-wide tiles
# (_tile: one program per SM at one token) took 0.84 / 0.72 / 0.67 / 0.65 / 0.62 / 0.59 / 0.56x the time of
# the 4 splits of 16-wide tiles before at T = 1 / 2 / 4 / 8 / 16 / 32 / 128 on the GLM-5 rank (22.7 us at
# T = 1, 3.4x its bytes floor; 213 us at 128, 1.03x), 0.85 - 0.58x on DeepSeek-V3.2's, and within 5% of the
# best of 36 tiles at every T (DeepSeek-V3.2's T = 1: 10%; H200, cold L2, gate/up + the split reduce launch then:
# moe_tiles_*.md). bf16 experts in 2 splits were 0.90x one at T = 1 but 1.16x at T = 4 (moe_split.md). A
# rule by shape only, so the row invariance holds (fused_moe's split_k).
# 4 splits (64-wide tiles) then took 0.83 - 1.03x the time of 2 at T = 1 - 128 on both ranks
# (logs/moe_tiles_*_split4_session17.md); in the GLM-5 rank on one machine, baseline and new in one run
# each: decode TPOT 7.97 / 10.36 / 19.44 ms against 8.14 / 10.38 / 19.46 at bs 1 / 4 / 32, end to end
# 234 / 141 / 87.5 tok/s/user against 236 / 134 / 87.3 at concurrency 1 / 8 / 32, TTFT 332 against 355 ms
# (logs/decode_rank_glm5_split4_session18.md, logs/decode_rank_glm5_split2_session18.md,
# logs/e2e_rank_glm5_split4_session18.md, logs/e2e_rank_glm5_split2_session18.md).
_FP8_SMALL_I, _FP8_SMALL_I_SPLIT = 256, 4


# The FP8 down: in the pair layout (a program per token looping over its k pairs' K blocks) 32-wide tiles of
# 2 warps and 3 stages (one program per SM at one token) took 0.94 / 0.69 / 0.45x the time of the 16-wide
# 4-warp 4-stage tiles before at T = 1 / 2 / 4 on the GLM-5 rank (14.4 / 16.3 / 19.1 us) and were within 5% of
# the best of 36 tiles at each; the sorted layout's 128-wide tiles 0.97 / 0.96x with 3 stages instead of 4 at
# T = 32 / 128 (H200, cold L2, moe_tiles_glm5-fp8-tp8-rank_down.md). Tiles never change a token's bits.
_FP8_DOWN_PER_TOKEN_WARPS, _FP8_DOWN_STAGES = 2, 3


def moe_split_k(intermediate_size: int, fp8: bool, block_m: int = BLOCK_M) -> int:
    """The gate/up K splits :class:`~dsaspec.layers.moe.RoutedExperts` passes to :func:`fused_moe` for
    experts of intermediate size ``intermediate_size`` (this rank's) and ``fp8`` weights on
    ``block_m``-row blocks: 4 for FP8 experts of I <= 256 on 16-row blocks, else 1 (the split fills
    the SMs a decode call leaves idle; tall blocks, :func:`moe_block_m`, have programs enough). A
    function of the shape and the block height, never of the token count itself."""
    return _FP8_SMALL_I_SPLIT if fp8 and intermediate_size <= _FP8_SMALL_I and block_m == BLOCK_M else 1


# The pair layout (no align, no combine) up to 64 pairs: T <= 7 at k + 1 = 9 slots (GLM-5 / DeepSeek-V3.2
# ranks with the shared expert), T <= 8 at 8. It saves two launches (align 6.0 us, combine ~3 us at T = 1 on
# the H200, decode_rank_glm5.md) and 2 P H fp32 bytes of partials (0.44 MB at T = 1, H 6144; 3.1 MB at
# P = 63), and costs down reads: an expert picked by n tokens is read n times, once per token's program. The
# shared expert's T - 1 extra reads come at the same step of every token's program (L2 hits); the routed
# repeats of k = 8 distinct picks of 256 are 0.25 / 1.5 / 5.0 experts at T = 2 / 4 / 7 (1.57 MB each at
# H 6144: 0.4 / 2.3 / 7.8 MB, under 2 us at 4.2 TB/s even from DRAM), 26 at T = 16 (41 MB, ~10 us: a loss).
# A rule by P only (the graph bucket's T), so a token's bits never depend on it (fused_moe's sort_pairs).
PAIR_LAYOUT_MAX_PAIRS = 64


def sorts_pairs(num_pairs: int) -> bool:
    """Whether :func:`fused_moe` sorts ``num_pairs`` (token, slot) pairs by expert (align, combine) by
    default: above :data:`PAIR_LAYOUT_MAX_PAIRS`; else the pair layout (module docstring)."""
    return num_pairs > PAIR_LAYOUT_MAX_PAIRS


def _pairs_pad(num_pairs: int) -> int:
    # the ids a pair-layout gate/up program ranks: one width (so one compiled kernel) up to the default
    # threshold, which also took fewer registers on sm_90 than narrower ones (FP8 split 4: 84 at 64, as
    # sorted, against 96 at 16 and 32; scripts/compile_fused_moe.py)
    return max(triton.next_power_of_2(PAIR_LAYOUT_MAX_PAIRS), triton.next_power_of_2(num_pairs))


def moe_block_m(num_tokens: int) -> int:
    """The row-block height :class:`~dsaspec.layers.moe.RoutedExperts` passes to :func:`fused_moe` for
    ``num_tokens`` tokens: :data:`BLOCK_M` (16) below ``PREFILL_MIN_ROWS``, else
    :data:`TALL_BLOCK_M`. A token's bits depend on it (module docstring: row invariance)."""
    return BLOCK_M if num_tokens < PREFILL_MIN_ROWS else TALL_BLOCK_M


def _check_block_m(block_m) -> None:
    if not isinstance(block_m, int) or isinstance(block_m, bool) or block_m not in BLOCK_MS:
        raise ValueError(f"block_m: expected one of {BLOCK_MS}, got {block_m!r}")


def max_blocks(num_pairs: int, num_experts: int, block_m: int = BLOCK_M) -> int:
    """Blocks of ``block_m`` rows that ``num_pairs`` pairs can need at most over ``num_experts``
    expert segments, each padded to a whole block: ``(P + min(E, P) * (block_m - 1)) // block_m``."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


@dataclass(frozen=True)
class FusedMoEWorkspace:
    """The static buffers of :func:`fused_moe` for up to ``max_tokens`` tokens (from
    :func:`fused_moe_workspace`). Every entry a call reads is written by that call first."""

    max_tokens: int
    topk: int
    num_experts: int
    hidden_size: int
    intermediate_size: int
    dtype: torch.dtype
    sorted_pairs: torch.Tensor  # int32 [max_blocks * block_m]: pair per sorted row, -1 = padding
    block_experts: torch.Tensor  # int32 [max_blocks]: expert of each block, -1 = unused
    expert_counts: torch.Tensor  # int32 [E]: the align programs' pairs per expert
    pair_ranks: torch.Tensor  # int32 [max_tokens * k]: each pair's rank among its expert's (align)
    act: torch.Tensor  # dtype [max_blocks * block_m, I]: silu(gate) * up per sorted row (pair layout: per pair)
    partial: torch.Tensor  # fp32 [max_tokens * k, H]: weighted down projection per pair (sorted layout)
    fp8: bool = False  # for FP8 experts: the quantized activations below are allocated
    hidden_q: torch.Tensor | None = None  # e4m3 [max_tokens, H]: act_quant of the hidden rows
    hidden_scale: torch.Tensor | None = None  # fp32 [max_tokens, H / 128]
    act_q: torch.Tensor | None = None  # e4m3 [max_blocks * block_m, I]: act_quant of act
    act_scale: torch.Tensor | None = None  # fp32 [max_blocks * block_m, I / 128]
    split_k: int = 1  # the most gate/up K splits a call may use
    gate_up: torch.Tensor | None = None  # fp32 [split_k, max_blocks * block_m, 2I] (split_k > 1)
    block_m: int = BLOCK_M  # the row-block height of the calls it serves (fused_moe's block_m)


def fused_moe_workspace(max_tokens: int, topk: int, num_experts: int, hidden_size: int,
                        intermediate_size: int, device, dtype: torch.dtype, *,
                        fp8: bool = False, split_k: int = 1, block_m: int = BLOCK_M) -> FusedMoEWorkspace:
    """Allocate the buffers of :func:`fused_moe` for calls of up to ``max_tokens`` tokens with
    ``topk`` experts per token out of ``num_experts``, hidden size H, intermediate size I and
    activations of ``dtype`` (bf16 or fp32); ``fp8``: for FP8 experts (also the e4m3 codes and
    scales of the quantized hidden rows and activations; H and I multiples of 128); ``split_k``:
    for calls of up to that many gate/up K splits (fp32 partials); ``block_m``: for calls of that
    row-block height (:func:`fused_moe`'s, which must match). Allocate once, before capture;
    a graph replays with the same workspace. Sizes: ``max_blocks(T * k, E, block_m) * block_m`` rows of I
    activations and ``T * k`` fp32 rows of H (at T = 512, k = 8, H = 7168: 117 MB), with
    ``split_k > 1`` also ``split_k`` fp32 partials of those rows x 2I (I = 256, split 4: 65 MB).
    Both layouts fit: the pair layout uses rows ``0..P-1`` of the activations and partials (``P <=
    max_blocks(P, E) * 16``) and neither the sorted pairs nor the fp32 partials of H.

    Raises ``TypeError`` / ``ValueError`` naming the argument unless the counts are ints >= 1,
    ``dtype`` is bf16 or fp32, ``block_m`` one of :data:`BLOCK_MS` and, with ``fp8``, H and I are
    multiples of 128."""
    for name, value in (("max_tokens", max_tokens), ("topk", topk), ("num_experts", num_experts),
                        ("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                        ("split_k", split_k)):
        check_count(name, value)
    _check_block_m(block_m)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: expected torch.bfloat16 or torch.float32, got {dtype}")
    if fp8:
        _check_fp8_dims(hidden_size, intermediate_size)
    pairs = max_tokens * topk
    rows = max_blocks(pairs, num_experts, block_m) * block_m
    quantized = {}
    if fp8:
        quantized = dict(
            hidden_q=torch.empty(max_tokens, hidden_size, dtype=FP8, device=device),
            hidden_scale=torch.empty(max_tokens, hidden_size // FP8_BLOCK, dtype=torch.float32, device=device),
            act_q=torch.empty(rows, intermediate_size, dtype=FP8, device=device),
            act_scale=torch.empty(rows, intermediate_size // FP8_BLOCK, dtype=torch.float32, device=device))
    if split_k > 1:
        quantized["gate_up"] = torch.empty(split_k, rows, 2 * intermediate_size, dtype=torch.float32,
                                           device=device)
    return FusedMoEWorkspace(
        max_tokens, topk, num_experts, hidden_size, intermediate_size, dtype,
        sorted_pairs=torch.empty(rows, dtype=torch.int32, device=device),
        block_experts=torch.empty(rows // block_m, dtype=torch.int32, device=device),
        expert_counts=torch.empty(num_experts, dtype=torch.int32, device=device),
        pair_ranks=torch.empty(pairs, dtype=torch.int32, device=device),
        act=torch.empty(rows, intermediate_size, dtype=dtype, device=device),
        partial=torch.empty(pairs, hidden_size, dtype=torch.float32, device=device), fp8=fp8,
        split_k=split_k, block_m=block_m, **quantized)


def _check_fp8_dims(hidden_size: int, intermediate_size: int) -> None:
    for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
        if value % FP8_BLOCK:
            raise ValueError(f"{name}: FP8 experts need a multiple of {FP8_BLOCK} (the 128 x 128 weight "
                             f"blocks, gate and up rows in separate blocks), got {value}")


@dataclass(frozen=True)
class _Tile:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# The tiles of tall blocks (block_m 64 / 128: prefill chunks, hundreds of pairs an expert and thousands of
# programs, so not sized from the SM count): (block_m, weight tiles: 2 gate/up, 1 down) -> (BLOCK_N, warps).
# Timed as a whole only (TALL_BLOCK_M's note; not swept): 128-wide down
# tiles; FP8 gate/up 128 wide at 64 rows (64 at 128 rows) in 8 warps, so the two fp32 accumulators and the
# two per-K-block dot results stay at 32 registers a thread each. Stages: as many as _STAGE_BYTES holds
# (at most _tile's per-kernel caps), at least 2 (bf16 halves BLOCK_K, else BLOCK_N, until two fit).
_TALL_TILES = {(64, 2): (128, 8), (64, 1): (128, 4), (128, 2): (64, 8), (128, 1): (128, 8)}


def _tile(n: int, k_dim: int, topk: int, dtype: torch.dtype, device: torch.device,
          weight_tiles: int = 1, fp8: bool = False, split_k: int = 1, per_token: bool = False,
          block_m: int = BLOCK_M) -> _Tile:
    """Tile of a grouped GEMM with N outputs and reduction K in ``split_k`` splits (never a function
    of T): bf16 and FP8 (e4m3 operands, one 128-column scale block per K step) tiles of
    ``BLOCK_N x 128``, fp32 (FMA) ``BLOCK_N x 32``, with ``BLOCK_N`` the widest of 128/64/32/16 that
    still gives a one-token call (``topk`` blocks, or one with ``per_token``: the pair layout's down, a
    program per token, x splits) about two programs per SM, one for the FP8 gate/up (``weight_tiles``
    2) and the FP8 pair-layout down (both measured: the notes on ``_FP8_SMALL_I`` and ``_FP8_DOWN_STAGES``)
    (off-GPU: the widest, so the interpreter runs few programs); up to 4 (bf16, FP8 gate/up), 3 (FP8
    down, fp32) stages of the activation tile and ``weight_tiles`` weight tiles within
    ``_STAGE_BYTES`` of shared memory; 4 warps (2 for the FP8 pair-layout down). Tall blocks
    (``block_m`` > 16): ``BLOCK_N`` and warps from :data:`_TALL_TILES`, at least 2 stages."""
    if fp8:
        dtype = FP8
        block_k, widths, num_warps, max_stages = FP8_BLOCK, (128, 64, 32, 16), 4, 4
        if weight_tiles == 1:
            num_warps, max_stages = (_FP8_DOWN_PER_TOKEN_WARPS if per_token else 4), _FP8_DOWN_STAGES
    elif dtype == torch.float32:
        block_k, widths, num_warps, max_stages = 32, (32, 16), 4, 3
    else:
        block_k, widths, num_warps, max_stages = 128, (128, 64, 32, 16), 4, 4
    if block_m > BLOCK_M:
        block_n, num_warps = _TALL_TILES[block_m, weight_tiles]
        if fp8:  # one weight scale per tile and K block
            block_n = min(block_n, FP8_BLOCK)
    else:
        one_per_sm = fp8 and (weight_tiles == 2 or per_token)
        wanted = (1 if one_per_sm else 2) * sm_count(device, without_cuda=1)
        programs = 1 if per_token else topk
        block_n = widths[-1]
        for width in widths:
            if programs * triton.cdiv(n, width) * split_k >= wanted:
                block_n = width
                break
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    block_k = min(block_k, max(16, triton.next_power_of_2(k_dim)))

    def stages() -> int:
        return _STAGE_BYTES // ((block_m + weight_tiles * block_n) * block_k * dtype.itemsize)

    while block_m > BLOCK_M and stages() < 2:  # tall blocks pipeline at least two stages
        if not fp8 and block_k > 32:
            block_k //= 2
        else:
            block_n //= 2
    return _Tile(block_n, block_k, num_warps, max(1, min(max_stages, stages())))


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _align_kernel(ids_ptr, counts_ptr, ranks_ptr, counter_ptr, sorted_pairs_ptr, block_experts_ptr, num_pairs,
                  num_blocks, NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, PAIR_CHUNK: tl.constexpr,
                  BLOCK_CHUNK: tl.constexpr, FILL: tl.constexpr, BLOCK_M: tl.constexpr, CHAINED: tl.constexpr):
    # program e: the ranks of expert e's pairs among them (a running count over the pairs in order)
    # to ranks_ptr[pair], their number to counts_ptr[e]; the last program to arrive (an atomic
    # counter it resets to 0) lays every pair out from the counts and ranks
    enter_chain(CHAINED)
    e = tl.program_id(0)
    offs = tl.arange(0, PAIR_CHUNK)
    seen = 0
    for start in range(0, num_pairs, PAIR_CHUNK):
        ids = tl.load(ids_ptr + start + offs, mask=start + offs < num_pairs, other=-1)
        hit = (ids == e).to(tl.int32)
        tl.store(ranks_ptr + start + offs, seen + tl.cumsum(hit, axis=0) - 1, mask=hit > 0)
        seen += tl.sum(hit, axis=0)
    tl.store(counts_ptr + e, seen)
    if last_to_arrive(counter_ptr, NUM_EXPERTS):
        experts = tl.arange(0, E_PAD)
        live = experts < NUM_EXPERTS
        counts = tl.load(counts_ptr + experts, mask=live, other=0, cache_modifier=".cg")
        seg_blocks = (counts + BLOCK_M - 1) // BLOCK_M
        block_start = tl.cumsum(seg_blocks, axis=0) - seg_blocks
        used = tl.sum(seg_blocks, axis=0)
        for start in range(0, num_blocks * BLOCK_M, FILL):
            rows = start + tl.arange(0, FILL)
            tl.store(sorted_pairs_ptr + rows, tl.full((FILL,), -1, tl.int32), mask=rows < num_blocks * BLOCK_M)
        for start in range(0, num_blocks, FILL):
            blocks = start + tl.arange(0, FILL)
            tl.store(block_experts_ptr + blocks, tl.full((FILL,), -1, tl.int32), mask=blocks < num_blocks)
        tl.debug_barrier()  # the padding is written before the pairs and the segment heads land on it
        # a segment's first block names its expert; the running max below spreads it to the segment
        tl.store(block_experts_ptr + block_start, experts, mask=live & (seg_blocks > 0))
        row_start = block_start * BLOCK_M
        for start in range(0, num_pairs, PAIR_CHUNK):
            ids = tl.load(ids_ptr + start + offs, mask=start + offs < num_pairs, other=-1)
            valid = (ids >= 0) & (ids < NUM_EXPERTS)
            rank = tl.load(ranks_ptr + start + offs, mask=valid, other=0, cache_modifier=".cg")
            row = tl.gather(row_start, tl.where(valid, ids, 0), 0) + rank
            tl.store(sorted_pairs_ptr + row, start + offs, mask=valid)
        tl.debug_barrier()  # the segment heads are written before the scan reads them
        carry = -1
        for start in range(0, num_blocks, BLOCK_CHUNK):
            blocks = start + tl.arange(0, BLOCK_CHUNK)
            named = tl.load(block_experts_ptr + blocks, mask=blocks < num_blocks, other=-1)
            expert = tl.maximum(tl.associative_scan(named, 0, _max_combine), carry)
            carry = tl.max(expert, axis=0)
            tl.store(block_experts_ptr + blocks, tl.where(blocks < used, expert, -1), mask=blocks < num_blocks)


@triton.jit
def _pair_lead(ids_ptr, pair, num_experts, PAIRS_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    # the pair layout: pair ``pair`` leads a block if its id is in [0, E) and its rank among its
    # expert's pairs (in pair order) is a multiple of BLOCK_M; returns (expert or -1, the rank)
    p = tl.arange(0, PAIRS_PAD)
    expert = tl.load(ids_ptr + pair)
    ids = tl.load(ids_ptr + p, mask=p < pair, other=-1)
    first = tl.sum((ids == expert).to(tl.int32), axis=0)
    lead = (first % BLOCK_M == 0) & (expert >= 0) & (expert < num_experts)
    return tl.where(lead, expert, -1), first


@triton.jit
def _pair_rows(ids_ptr, expert, first, num_pairs, PAIRS_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    # a leading pair's block: the pair of each row, the expert's pairs of ranks [first, first + BLOCK_M)
    # in order, -1 padding (the sorted layout's block of those ranks)
    p = tl.arange(0, PAIRS_PAD)[None, :]
    same = ((tl.load(ids_ptr + p, mask=p < num_pairs, other=-1) == expert)).to(tl.int32)
    rank = tl.cumsum(same, axis=1) - same
    hit = (same > 0) & (rank == first + tl.arange(0, BLOCK_M)[:, None])
    return tl.max(tl.where(hit, p, -1), axis=1)


@triton.jit(do_not_specialize=["num_blocks"])
def _gate_up_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, sorted_pairs_ptr, block_experts_ptr, gate_up_ptr, act_ptr,
                    q_ptr, qs_ptr, counters_ptr, num_blocks, num_experts, H, I, stride_xt, stride_xst, stride_we,
                    stride_wn, stride_wse, stride_wsn, stride_gate_up, stride_act, stride_q, stride_qs, k_span,
                    stride_split, num_groups, TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, GROUP: tl.constexpr, UPCAST: tl.constexpr,
                    FP8: tl.constexpr, UE8M0: tl.constexpr, PAIRS: tl.constexpr, PAIRS_PAD: tl.constexpr,
                    CHAINED: tl.constexpr):
    # FP8: x and w are e4m3 codes, xs [T, H / BLOCK_K] and ws [E, 2I / BLOCK_K, H / BLOCK_K] their
    # scales, BLOCK_K = 128 and BLOCK_N divides 128 (one weight scale per tile and K block)
    # blocks vary fastest: the programs that read one weight tile run together (L2 reuse)
    # SPLIT > 1: this program sums K in [split * k_span, (split + 1) * k_span) (k_span a multiple
    # of BLOCK_K) and writes fp32 gate / up to gate_up_ptr + split * stride_split (columns I + c: up);
    # the last of the SPLIT * GROUP / BLOCK_N programs of its block's GROUP columns to arrive (a counter
    # per block and group, reset by that program) adds the partials in split order and writes act (and
    # with FP8 act_quant's codes and scale of each row's GROUP = 128 columns)
    # PAIRS: the pair layout, num_blocks = P pairs, block_experts_ptr = topk_ids; a row's outputs go
    # to row p of its pair (sorted: row block * BLOCK_M + i)
    wait_in_chain(CHAINED)
    pid = tl.program_id(0)
    block = pid % num_blocks
    split = pid // num_blocks % SPLIT
    pid_n = pid // num_blocks // SPLIT
    k_start = split * k_span
    if PAIRS:
        expert, first = _pair_lead(block_experts_ptr, block, num_experts, PAIRS_PAD, BLOCK_M)
        if expert < 0:
            return
        pairs = _pair_rows(block_experts_ptr, expert, first, num_blocks, PAIRS_PAD, BLOCK_M)
        rows = tl.where(pairs >= 0, pairs, 0)
    else:
        expert = tl.load(block_experts_ptr + block)
        if expert < 0:
            return
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(sorted_pairs_ptr + rows)
    row_ok = pairs >= 0
    tokens = tl.where(row_ok, pairs // TOPK, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + (k_start + ks)[None, :]
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    g_ptrs = w_expert + cols.to(tl.int64)[None, :] * stride_wn + (k_start + ks)[:, None]
    u_ptrs = g_ptrs + I * stride_wn
    xs_ptrs = xs_ptr + tokens * stride_xst
    gs_ptr = ws_ptr + expert.to(tl.int64) * stride_wse + (pid_n * BLOCK_N // BLOCK_K) * stride_wsn
    us_ptr = gs_ptr + (I // BLOCK_K) * stride_wsn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, tl.minimum(H, k_start + k_span), BLOCK_K):
        k_ok = (k + ks) < H
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's bf16 dot multiplies the raw bits
            x = x.to(tl.float32)
            g = g.to(tl.float32)
            u = u.to(tl.float32)
        if FP8:
            kb = k // BLOCK_K
            x_s = tl.load(xs_ptrs + kb, mask=row_ok, other=0.0)[:, None]
            gate += tl.dot(x, g) * (x_s * tl.load(gs_ptr + kb))
            up += tl.dot(x, u) * (x_s * tl.load(us_ptr + kb))
        else:
            gate = tl.dot(x, g, gate, input_precision="ieee")
            up = tl.dot(x, u, up, input_precision="ieee")
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT == 1:
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(act_ptr + rows.to(tl.int64)[:, None] * stride_act + cols[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=mask)
    else:
        partial_ptrs = gate_up_ptr + rows.to(tl.int64)[:, None] * stride_gate_up + cols[None, :]
        tl.store(partial_ptrs + split.to(tl.int64) * stride_split, gate, mask=mask)
        tl.store(partial_ptrs + split.to(tl.int64) * stride_split + I, up, mask=mask)
        group = pid_n * BLOCK_N // GROUP
        if last_to_arrive(counters_ptr + block * num_groups + group, SPLIT * (GROUP // BLOCK_N)):
            _reduce_splits(gate_up_ptr, act_ptr, q_ptr, qs_ptr, rows, row_ok, group, I, stride_gate_up, stride_act,
                           stride_q, stride_qs, stride_split, SPLIT, BLOCK_M, GROUP, FP8, UE8M0)


@triton.jit
def _reduce_splits(gate_up_ptr, act_ptr, q_ptr, qs_ptr, rows, row_ok, group, I, stride_gate_up, stride_act, stride_q,
                   stride_qs, stride_split, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr,
                   QUANTIZE: tl.constexpr, UE8M0: tl.constexpr):
    # act[r, c] = silu(sum_s gate_up[s, r, c]) * sum_s gate_up[s, r, I + c], s = 0..SPLIT-1 in order, over
    # the rows' live entries and the group's columns; QUANTIZE: also act_quant's codes and scale of the
    # stored act (GROUP = 128 columns, one scale a row)
    cols = group * GROUP + tl.arange(0, GROUP)
    mask = row_ok[:, None] & (cols < I)[None, :]
    ptrs = gate_up_ptr + rows.to(tl.int64)[:, None] * stride_gate_up + cols[None, :]
    gate = tl.zeros((BLOCK_M, GROUP), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, GROUP), dtype=tl.float32)
    for s in tl.static_range(SPLIT):  # .cg: the other programs' partials from L2, not a stale L1
        gate += tl.load(ptrs + s * stride_split, mask=mask, other=0.0, cache_modifier=".cg")
        up += tl.load(ptrs + s * stride_split + I, mask=mask, other=0.0, cache_modifier=".cg")
    act = (gate / (1.0 + tl.exp(-gate)) * up).to(act_ptr.dtype.element_ty)
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * stride_act + cols[None, :], act, mask=mask)
    if QUANTIZE:  # the stored values, as act_quant would load them
        codes, scale = quantize_rows(act.to(tl.float32), UE8M0)
        tl.store(q_ptr + rows.to(tl.int64)[:, None] * stride_q + cols[None, :], codes.to(q_ptr.dtype.element_ty),
                 mask=mask)
        tl.store(qs_ptr + rows.to(tl.int64) * stride_qs + group, scale, mask=row_ok)


@triton.jit
def _down_step(a_ptrs, as_ptrs, w_ptrs, s_ptr, kb, a_mask, row_ok, w_mask, acc, UPCAST: tl.constexpr,
               FP8: tl.constexpr):
    # acc plus one K block of the activation rows times the weight tile (FP8: times their scales)
    a = tl.load(a_ptrs, mask=a_mask, other=0.0)
    w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    if UPCAST:
        a = a.to(tl.float32)
        w = w.to(tl.float32)
    if FP8:
        a_s = tl.load(as_ptrs + kb, mask=row_ok, other=0.0)[:, None]
        acc += tl.dot(a, w) * (a_s * tl.load(s_ptr + kb))
    else:
        acc = tl.dot(a, w, acc, input_precision="ieee")
    return acc


@triton.jit(do_not_specialize=["num_blocks"])
def _down_kernel(act_ptr, as_ptr, w_ptr, ws_ptr, sorted_pairs_ptr, block_experts_ptr, weights_ptr,
                 out_ptr, num_blocks, num_experts, H, I, stride_act, stride_as, stride_we, stride_wn, stride_wse,
                 stride_wsn, stride_out, TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr, PAIRS: tl.constexpr,
                 TOPK_PAD: tl.constexpr, CHAINED: tl.constexpr):
    # FP8: act and w are e4m3 codes, as [rows, I / BLOCK_K] and ws [E, ceil(H / BLOCK_K), I / BLOCK_K]
    # their scales (as in _gate_up_kernel)
    # sorted: program (block, n) writes its rows' weighted fp32 partials to out_ptr (the partial buffer,
    # row p for pair p); PAIRS: program (token, n), num_blocks = T, block_experts_ptr = topk_ids: the
    # token's TOPK pairs in order, each its tile product (act row p in row 0 of the tile) times its
    # weight, added to an fp32 sum (the combine's), cast and written to out_ptr[token]
    enter_chain(CHAINED)
    pid = tl.program_id(0)
    block = pid % num_blocks
    pid_n = pid // num_blocks
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    ks = tl.arange(0, BLOCK_K)
    m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PAIRS:
        slots = tl.arange(0, TOPK_PAD)
        token_ids = tl.load(block_experts_ptr + block * TOPK + slots, mask=slots < TOPK, other=-1)
        token_weights = tl.load(weights_ptr + block * TOPK + slots, mask=slots < TOPK, other=0.0)
        nk = tl.cdiv(I, BLOCK_K)
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # one loop over every pair's K blocks, ids and weights from registers: pipelined across pairs
        for step in range(0, TOPK * nk):
            j = step // nk
            k = (step - j * nk) * BLOCK_K
            pair = block * TOPK + j
            expert = tl.sum(tl.where(slots == j, token_ids, 0), axis=0)
            ok = (expert >= 0) & (expert < num_experts)  # else zeros: the combine skips the pair
            expert = tl.where(ok, expert, 0)
            row_ok = (m == 0) & ok
            k_ok = (k + ks) < I
            rows = pair.to(tl.int64) + tl.zeros((BLOCK_M,), tl.int64)
            a_ptrs = act_ptr + rows[:, None] * stride_act + (k + ks)[None, :]
            w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn
                      + (k + ks)[:, None])
            s_ptr = ws_ptr + expert.to(tl.int64) * stride_wse + (pid_n * BLOCK_N // BLOCK_K) * stride_wsn
            acc = _down_step(a_ptrs, as_ptr + rows * stride_as, w_ptrs, s_ptr, k // BLOCK_K,
                             row_ok[:, None] & k_ok[None, :], row_ok, ok & k_ok[:, None] & col_ok[None, :], acc,
                             UPCAST, FP8)
            if k + BLOCK_K >= I:
                weight = tl.sum(tl.where((slots == j) & ok, token_weights, 0.0), axis=0)
                total += acc * weight
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        out_ptrs = out_ptr + (block.to(tl.int64) + 0 * m)[:, None] * stride_out + cols[None, :]
        tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=(m == 0)[:, None] & col_ok[None, :])
    else:
        expert = tl.load(block_experts_ptr + block)
        if expert < 0:
            return
        rows = block * BLOCK_M + m
        pairs = tl.load(sorted_pairs_ptr + rows)
        row_ok = pairs >= 0
        a_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_act + ks[None, :]
        w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn
                  + ks[:, None])
        as_ptrs = as_ptr + rows.to(tl.int64) * stride_as
        s_ptr = ws_ptr + expert.to(tl.int64) * stride_wse + (pid_n * BLOCK_N // BLOCK_K) * stride_wsn
        for k in range(0, I, BLOCK_K):
            k_ok = (k + ks) < I
            acc = _down_step(a_ptrs, as_ptrs, w_ptrs, s_ptr, k // BLOCK_K, row_ok[:, None] & k_ok[None, :],
                             row_ok, k_ok[:, None] & col_ok[None, :], acc, UPCAST, FP8)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        weight = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)
        out_ptrs = (out_ptr + tl.where(row_ok, pairs, 0).to(tl.int64)[:, None] * stride_out
                    + cols[None, :])
        tl.store(out_ptrs, acc * weight[:, None], mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["T"])
def _combine_kernel(partial_ptr, ids_ptr, out_ptr, T, H, stride_partial, stride_out,
                    TOPK: tl.constexpr, NUM_EXPERTS: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_H: tl.constexpr, CHAINED: tl.constexpr):
    enter_chain(CHAINED)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    token_ok = tokens < T
    col_ok = cols < H
    tokens = tokens.to(tl.int64)
    total = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in range(TOPK):
        pairs = tokens * TOPK + j
        expert = tl.load(ids_ptr + pairs, mask=token_ok, other=-1)
        ok = token_ok & (expert >= 0) & (expert < NUM_EXPERTS)  # an unplaced pair's row is stale
        total += tl.load(partial_ptr + pairs[:, None] * stride_partial + cols[None, :],
                         mask=ok[:, None] & col_ok[None, :], other=0.0)
    tl.store(out_ptr + tokens[:, None] * stride_out + cols[None, :],
             total.to(out_ptr.dtype.element_ty), mask=token_ok[:, None] & col_ok[None, :])


def _check_inputs(hidden, w13, w2, topk_ids, topk_weights, out, w13_scale, w2_scale, workspace,
                  split_k, sort_pairs, hidden_codes, block_m) -> bool:
    """Check the arguments; returns whether the experts are FP8."""
    check_count("split_k", split_k)
    _check_block_m(block_m)
    if sort_pairs is not None and not isinstance(sort_pairs, bool):
        raise TypeError(f"sort_pairs: expected None or a bool, got {sort_pairs!r}")
    if sort_pairs is False and block_m != BLOCK_M:
        raise ValueError(f"sort_pairs: the pair layout (False) runs {BLOCK_M}-row blocks only, got block_m "
                         f"{block_m}; pass True or None")
    check_tensor("hidden", hidden, dtype=_DTYPES, ndim=2)
    tokens, h = hidden.shape
    dtype, device = hidden.dtype, hidden.device
    check_tensor("w13", w13, dtype=(dtype, FP8), ndim=3, device=device)
    fp8 = w13.dtype == FP8
    experts, two_i, _ = w13.shape
    if experts < 1 or two_i < 2 or two_i % 2 or w13.shape[2] != h:
        raise ValueError(f"w13: expected shape (E >= 1, 2 * I >= 2, {h}) (gate rows then up rows), "
                         f"got {tuple(w13.shape)}")
    inter = two_i // 2
    check_tensor("w2", w2, dtype=w13.dtype, shape=(experts, h, inter), device=device)
    if fp8:
        _check_fp8_dims(h, inter)
        for name, scale, shape in (("w13_scale", w13_scale, (experts, two_i // FP8_BLOCK, h // FP8_BLOCK)),
                                   ("w2_scale", w2_scale, (experts, h // FP8_BLOCK, inter // FP8_BLOCK))):
            if scale is None:
                raise ValueError(f"{name}: FP8 (e4m3) experts need their fp32 block scales, got None")
            check_tensor(name, scale, dtype=torch.float32, shape=shape, device=device)
            if not scale.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous tensor, got strides {scale.stride()}")
    else:
        for name, given, what in (("w13_scale", w13_scale, "block scales"), ("w2_scale", w2_scale, "block scales"),
                                  ("hidden_codes", hidden_codes, "quantized rows")):
            if given is not None:
                raise ValueError(f"{name}: {what} go with e4m3 experts; w13 is {w13.dtype}")
    if fp8 and hidden_codes is not None:
        if not isinstance(hidden_codes, tuple) or len(hidden_codes) != 2:
            raise TypeError(f"hidden_codes: expected a (codes, scales) tuple, got {type(hidden_codes).__name__}")
        check_tensor("hidden_codes[0]", hidden_codes[0], dtype=FP8, shape=(tokens, h), device=device)
        check_tensor("hidden_codes[1]", hidden_codes[1], dtype=torch.float32, shape=(tokens, h // FP8_BLOCK),
                     device=device)
    check_tensor("topk_ids", topk_ids, dtype=torch.int32, shape=(tokens, None), device=device)
    topk = topk_ids.shape[1]
    if topk < 1:
        raise ValueError(f"topk_ids: expected k >= 1 experts per token, got shape {tuple(topk_ids.shape)}")
    check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(tokens, topk), device=device)
    for name, tensor in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {tensor.stride()}")
    check_tensor("out", out, dtype=dtype, shape=(tokens, h), device=device)
    if workspace is None:
        return fp8
    if not isinstance(workspace, FusedMoEWorkspace):
        raise TypeError(f"workspace: expected a FusedMoEWorkspace (fused_moe_workspace), got "
                        f"{type(workspace).__name__}")
    got = (workspace.topk, workspace.num_experts, workspace.hidden_size,
           workspace.intermediate_size, workspace.dtype)
    if got != (topk, experts, h, inter, dtype) or tokens > workspace.max_tokens:
        raise ValueError(f"workspace: sized for <= {workspace.max_tokens} tokens, (k, E, H, I, dtype) = "
                         f"{got}; this call has {tokens} tokens, {(topk, experts, h, inter, dtype)}")
    if workspace.block_m != block_m:
        raise ValueError(f"workspace: allocated for block_m {workspace.block_m}, this call has block_m {block_m}")
    if workspace.fp8 != fp8:
        raise ValueError(f"workspace: allocated with fp8={workspace.fp8}, but the experts are {w13.dtype}")
    if split_k > 1 and workspace.split_k < split_k:
        raise ValueError(f"workspace: allocated for split_k <= {workspace.split_k}, this call has "
                         f"split_k {split_k}")
    if workspace.partial.device != device:
        raise ValueError(f"workspace: expected device {device}, got {workspace.partial.device}")
    return fp8


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, out: torch.Tensor, *, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, scale_fmt: str | None = None,
              workspace: FusedMoEWorkspace | None = None, split_k: int = 1,
              sort_pairs: bool | None = None, check_values: bool = True,
              hidden_codes: tuple[torch.Tensor, torch.Tensor] | None = None,
              block_m: int = BLOCK_M) -> torch.Tensor:
    """Routed-expert MLP: ``out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(w13[e, :I] @ x) *
    (w13[e, I:] @ x))``, ``x = hidden[t]``, ``e = topk_ids[t, j]``; fp32 accumulation, the
    activation rounded once to the hidden dtype, the k weighted expert outputs summed in fp32 in
    order j = 0..k-1 and cast once. At one ``block_m`` and ``split_k`` a token's output is bitwise
    independent of T and of the other tokens; a caller that picks ``block_m`` by T (:func:`moe_block_m`)
    keeps that only below ``PREFILL_MIN_ROWS`` (module docstring). Repeated ids within a row are
    allowed: each slot counts on its own.

    FP8 experts (``w13`` / ``w2`` e4m3 with ``w13_scale`` / ``w2_scale``): ``W = w * scale`` per
    128 x 128 block of each expert's projection; ``x`` and the activation are quantized per token per
    128 columns (:func:`~dsaspec.ops.fp8_gemm.act_quant`, ``scale_fmt``) before their GEMMs, whose
    128-column blocks are scaled and summed in fp32.

    Parameters
    ----------
    hidden : ``[T, H]`` bf16 or fp32, unit last stride. T = 0 writes nothing.
    w13 : ``[E, 2 * I, H]``, hidden's dtype (or e4m3) and device, unit last stride: gate rows, then
        up rows.
    w2 : ``[E, H, I]``, w13's dtype, hidden's device, unit last stride.
    topk_ids : int32 ``[T, k]``, k >= 1, contiguous, each in ``[0, E)``.
    topk_weights : fp32 ``[T, k]``, contiguous.
    out : ``[T, H]``, hidden's dtype, unit last stride; written (every entry). May be ``hidden``.
    w13_scale, w2_scale : with e4m3 experts (H and I multiples of 128), fp32 contiguous ``[E, 2I /
        128, H / 128]`` (the gate blocks' ``weight_scale_inv``, then the up blocks') and ``[E,
        H / 128, I / 128]``; else None.
    scale_fmt : the activation scales, None (fp32) or ``"ue8m0"`` (powers of two), FP8 only.
    workspace : from :func:`fused_moe_workspace` for >= T tokens and this call's (k, E, H, I,
        dtype, fp8), ``split_k`` and ``block_m``; None allocates one (not for graph capture).
    split_k : gate/up programs per output tile, each over a contiguous ``1 / split_k`` of the K
        blocks, their fp32 sums added in order (module docstring). It changes the summation order:
        fix it per shape (E, k, H, I, dtype), never per T, or a token's bits depend on T. Splits
        beyond the K blocks add zeros.
    sort_pairs : the block layout (module docstring): True sorts the pairs (align, down, combine),
        False lays them out by pair (down sums each token's pairs itself: two launches fewer; 16-row
        blocks only), None (default) :func:`sorts_pairs` of ``T * k`` at 16 rows, True for taller
        blocks. Both give the same bits; any workspace for T tokens serves both.
    check_values : also check that every id is in ``[0, E)`` (a host sync, so not inside CUDA
        graphs). Shapes, dtypes and devices are always checked. Graph replay relies on the caller
        for the range; an id outside it contributes nothing (reads and writes nothing).
    hidden_codes : with e4m3 experts, ``act_quant(hidden, scale_fmt)`` written ahead (e4m3 ``[T, H]``,
        fp32 ``[T, H / 128]``, unit last strides; the norm before the MoE writes them), read instead of
        quantizing ``hidden`` in a launch of its own; what it holds is not checked against
        ``hidden``. None (default): quantized here.
    block_m : the row-block height, one of :data:`BLOCK_MS` (16 default; 64 / 128 for prefill chunks,
        :func:`moe_block_m`): each expert's segment is padded to it and the GEMM tiles have that many
        rows. It changes the summation (FP8 from 64 rows: the e4m3 warpgroup MMA), so a token's bits
        differ between heights. ``ValueError`` for another value, or ``sort_pairs=False`` with a taller one.

    Returns
    -------
    ``out``.
    """
    fp8 = _check_inputs(hidden, w13, w2, topk_ids, topk_weights, out, w13_scale, w2_scale, workspace,
                        split_k, sort_pairs, hidden_codes, block_m)
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"scale_fmt: expected one of {SCALE_FORMATS}, got {scale_fmt!r}")
    tokens, h = hidden.shape
    experts, inter = w13.shape[0], w13.shape[1] // 2
    topk = topk_ids.shape[1]
    if check_values and tokens:
        low, high = int(topk_ids.min()), int(topk_ids.max())
        if low < 0 or high >= experts:
            raise ValueError(f"topk_ids: expected ids in [0, {experts}), got values in [{low}, {high}]")
    if tokens == 0:
        return out
    if workspace is None:
        workspace = fused_moe_workspace(tokens, topk, experts, h, inter, hidden.device, hidden.dtype, fp8=fp8,
                                        split_k=split_k, block_m=block_m)
    pairs = tokens * topk
    sort = (sorts_pairs(pairs) or block_m > BLOCK_M) if sort_pairs is None else sort_pairs
    chained = supports_pdl(hidden.device)
    if sort:
        blocks = max_blocks(pairs, experts, block_m)
        e_pad = triton.next_power_of_2(experts)
        _align_kernel[(experts,)](topk_ids, workspace.expert_counts, workspace.pair_ranks,
                                  tile_counters(hidden.device, 1), workspace.sorted_pairs, workspace.block_experts,
                                  pairs, blocks, NUM_EXPERTS=experts, E_PAD=e_pad, PAIR_CHUNK=_ALIGN_PAIR_CHUNK,
                                  BLOCK_CHUNK=_ALIGN_BLOCK_CHUNK, FILL=1024, BLOCK_M=block_m, CHAINED=chained,
                                  launch_pdl=chained, num_warps=_ALIGN_WARPS)
        # the rows of act and its codes: the blocks' (padding rows too), a live one's pair in [0, P)
        row_ids, block_experts, rows, down_blocks = (
            workspace.sorted_pairs, workspace.block_experts, blocks * block_m, blocks)
    else:  # pair layout: a block per pair; row p pair p's, live where its id is in [0, E); down per token
        blocks = pairs
        row_ids, block_experts, rows, down_blocks = topk_ids, topk_ids, pairs, tokens
    upcast = not hidden.is_cuda and not fp8
    act, partial = workspace.act, workspace.partial
    x, x_scale, w13_s, a, a_scale, w2_s = hidden, hidden, w13, act, act, w2  # unread without FP8
    if fp8:
        x, x_scale = hidden_codes if hidden_codes is not None else act_quant(
            hidden, scale_fmt, out=workspace.hidden_q[:tokens], scale_out=workspace.hidden_scale[:tokens])
        a, a_scale, w13_s, w2_s = workspace.act_q, workspace.act_scale, w13_scale, w2_scale
    tile = _tile(inter, h, topk, hidden.dtype, hidden.device, weight_tiles=2, fp8=fp8, split_k=split_k,
                 block_m=block_m)
    k_span = triton.cdiv(triton.cdiv(h, tile.block_k), split_k) * tile.block_k
    # a split's reduction covers GROUP columns: FP8 one 128-column scale block (several tiles), else a tile
    group = FP8_BLOCK if fp8 else tile.block_n
    # a counter per block (the pair layout's: a pair's) and group, from the device's shared zeroed counters
    gate_up, counters = ((workspace.gate_up, tile_counters(hidden.device, blocks * triton.cdiv(inter, group)))
                         if split_k > 1 else (act, act))
    _gate_up_kernel[(blocks * split_k * triton.cdiv(inter, tile.block_n),)](
        x, x_scale, w13, w13_s, row_ids, block_experts, gate_up, act, a, a_scale, counters, blocks, experts, h,
        inter, x.stride(0), x_scale.stride(0), w13.stride(0), w13.stride(1), w13_s.stride(0), w13_s.stride(1),
        gate_up.stride(-2), act.stride(0), a.stride(0), a_scale.stride(0), k_span,
        gate_up.stride(0) if split_k > 1 else 0, triton.cdiv(inter, group), TOPK=topk, BLOCK_M=block_m,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, SPLIT=split_k, GROUP=group, UPCAST=upcast, FP8=fp8,
        UE8M0=scale_fmt == "ue8m0", PAIRS=not sort, PAIRS_PAD=block_m if sort else _pairs_pad(pairs),
        CHAINED=chained, launch_pdl=chained, num_warps=tile.num_warps, num_stages=tile.num_stages)
    if fp8 and split_k == 1:  # every row in use: padding rows are quantized too and never read
        act_quant(act[:rows], scale_fmt, out=a[:rows], scale_out=a_scale[:rows])
    # the down programs: a block's (sorted) or a token's (pair layout) x BLOCK_N columns, so the pair
    # layout sizes its tile for one program per token; no FMA contraction, so the pair layout's fp32
    # sum of weighted products has the combine's bits. Chained behind gate/up's exit (wait_in_chain): released
    # at gate/up's start, it took 20.5 -> 29.7 µs a layer at T 4 on an H100, its waiting programs likely
    # holding the SMs gate/up's later programs needed
    tile = _tile(h, inter, topk, hidden.dtype, hidden.device, fp8=fp8, per_token=not sort, block_m=block_m)
    target = partial if sort else out
    _down_kernel[(down_blocks * triton.cdiv(h, tile.block_n),)](
        a, a_scale, w2, w2_s, row_ids, block_experts, topk_weights, target, down_blocks, experts, h, inter,
        a.stride(0), a_scale.stride(0), w2.stride(0), w2.stride(1), w2_s.stride(0), w2_s.stride(1),
        target.stride(0), TOPK=topk, BLOCK_M=block_m,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, UPCAST=upcast, FP8=fp8, PAIRS=not sort,
        TOPK_PAD=triton.next_power_of_2(topk), CHAINED=chained, launch_pdl=chained, num_warps=tile.num_warps,
        num_stages=tile.num_stages, enable_fp_fusion=False)
    if sort:
        block_h = min(_COMBINE_ELEMENTS, triton.next_power_of_2(h))
        block_t = min(triton.next_power_of_2(tokens), _COMBINE_ELEMENTS // block_h)
        _combine_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(h, block_h))](
            partial, topk_ids, out, tokens, h, partial.stride(0), out.stride(0),
            TOPK=topk, NUM_EXPERTS=experts, BLOCK_T=block_t, BLOCK_H=block_h, CHAINED=chained,
            launch_pdl=chained, num_warps=4)
    return out
