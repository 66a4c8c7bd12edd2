"""Lightning-indexer logits over each query row's live tokens, read through the page table.

``out[r, t] = sum_h weights[r, h] * relu(q[r, h] . k_cache[page_table_1[r, t]])`` for
``t < seqlens[r]``. The grid is one program per schedule entry (``num_sms``, fixed at capture);
program ``i`` walks its share of (row, 64-token block) pairs from ``dsaspec.ops.indexer_schedule``,
so the cost follows the live lengths and never the page-table width, and rows the schedule skips
(``skip_len``) cost nothing. Per block: gather the 64 keys (software-pipelined over the row's
blocks), one tensor-core dot with the block's tokens as the M dimension against the row's heads
(loaded once per row), ReLU, the weighted sum over heads. With ``rows_per_group`` G the unit is
G rows sharing a page table (target verify), whose G * H (row, head) pairs share each key read
(docs/dsa-kernels.md).

FP8 key caches (uint8 ``[pages, 8448]``, :mod:`dsaspec.ops.kv_cache_layout`) run the same kernel
with ``FP8`` on, the math of DeepSeek-V3.2's ``fp8_index``: each (row, head) query is quantized to
e4m3 with one ue8m0 scale (:mod:`dsaspec.ops.e4m3`) once per row, its scale folded into the head
weight; the dot is e4m3 x e4m3 with fp32 accumulation; the token's key scale multiplies the head
sum. Every scale is a power of two, so applying them is exact (docs/fp8-kv-cache.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from dsaspec.ops.checks import check_live_width, check_tensor
from dsaspec.ops.device import enter_chain, resident_registers, supports_pdl
from dsaspec.ops.e4m3 import quantize_rows
from dsaspec.ops.indexer_schedule import (INDEXER_BLOCK_KV, PROGRAMS_PER_SM, check_rows_per_group,
                                          indexer_programs)
from dsaspec.ops.kv_cache_layout import (INDEX_FP8_PAGE_BYTES, INDEX_HEAD_DIM, PAGE_SIZE,
                                         index_k_fp8_views, is_fp8_cache)


@dataclass(frozen=True)
class IndexerConfig:
    """Launch configuration of :func:`indexer_logits` (the result does not depend on it beyond
    fp32 summation order).

    tokens_as_m : the dot's M dimension is the block's 64 tokens (``keys @ q^T``, one Hopper
        warpgroup MMA per block, the head sum stays within a thread quad) instead of the heads.
    num_warps : warps per program.
    num_stages : software-pipelining depth of the loop over a row's blocks (key gathers in
        flight ahead of the dot).
    page_blocks : read each 64-position block as one page: one page-table entry (the block's
        first) names the page, then the block's keys (and FP8 scales) are one contiguous run
        instead of 64 gathers. Needs page-consistent tables (:func:`indexer_logits`,
        ``page_table_1``), which the runtime's page allocator writes.
    max_registers : cap on a thread's registers (ptxas ``maxnreg``), so that the schedule's
        programs per SM are all resident (:func:`dsaspec.ops.device.resident_registers`); None: the
        compiler's count.
    programs_per_sm : the schedule this configuration runs with: programs (schedule entries) per
        SM, ``indexer_programs(device, programs_per_sm)``; the kernel takes whatever schedule it
        is given, so this is what its callers size the schedule by.
    """

    tokens_as_m: bool
    num_warps: int
    num_stages: int
    page_blocks: bool = False
    max_registers: int | None = None
    programs_per_sm: int = PROGRAMS_PER_SM


INDEXER_CONFIG = IndexerConfig(tokens_as_m=True, num_warps=4, num_stages=3)
# FP8 keys: a block is 8.4 KB instead of 16 KB, so twice the pipelining depth keeps as many bytes in
# flight (the loop is bound by gathers in flight, not by bandwidth: at 3 stages the FP8 kernel took
# the bf16 kernel's time, 175 against 185 µs at bs 32 / 64k, H200), and each 64-position block is read
# as one page (contiguous codes and scales, one page-table entry): the fastest of the FP8 tune's
# candidates at every decode point, 0.62-0.64x the 8-warp gather form at bs 32-64 / 64k (89 and 169 µs
# at 3 programs per SM, GLM-5's 32 index heads; benchmarks/results/h200/dsa_ops_tune_fp8_indexer.md).
# Needs page-consistent tables, which the runtime's allocator writes (the eager check names a block
# that is not).
#
# Registers: with 64 index heads (DeepSeek-V3.2) the 4-warp kernel takes 185 registers a thread, so only
# 2 of the schedule's 3 programs an SM were resident (the third ran as a second wave); capped at 168 (3 x
# 128 threads fit, no spills) it took 0.70 - 0.75x the time at bs 16 - 64 / 64k; 8 stages took 0.96 -
# 1.01x the time of 6 on both presets (benchmarks/results/h200/logs/idx_tune_v32_session18.md,
# logs/idx_tune_glm5_tma_session18.md). GLM-5's 32 index heads take 122 registers: the cap changes
# nothing there.
INDEXER_FP8_CONFIG = IndexerConfig(tokens_as_m=True, num_warps=4, num_stages=8, page_blocks=True,
                                   max_registers=resident_registers(PROGRAMS_PER_SM, 4))
# Row groups (target verify) on FP8 keys: the compiler's register count (255 at G = 4; capped at 168 a
# G = 4 group spills, 560 B of stack at 32 index heads, 2,360 at 64; sm_90 offline compile). From
# WIDE_GROUP_COLUMNS dot columns (G x H: DeepSeek-V3.2's 64 index heads at G = 4) 8 warps: on 4 the
# [64, 256] fp32 scores alone are 128 registers a thread and the kernel spills 1,160 B; on 8 it does not,
# and took 0.69 / 0.77x the 4-warp time at bs 32 / 64, 64k (GLM-5's G = 4, 128 columns: 1.08 / 1.05x, so
# it keeps 4; benchmarks/results/h200/logs/idx_tune_verify_v32_session18.md,
# logs/idx_tune_verify_glm5_session18.md).
#
# Programs per SM: as many as are resident at once, at most PROGRAMS_PER_SM (a CPU test compiles every
# default for sm_90 and checks it). The row groups' kernels hold more registers, so the schedule's
# third program an SM ran as a second wave: the uncapped 4-warp FP8 groups (255 registers) and the
# bf16 kernel on wide groups (254 registers, 97 KiB of shared memory at G = 4 and 64 heads) fit 2, the
# 8-warp FP8 groups (255 registers) 1. At bs 32 / 64, 64k (H200): GLM-5's FP8 groups at 2 an SM took
# 0.79 / 0.77x the time at 3, bf16 groups of 64 heads at 2 0.78 / 0.78x, the 8-warp FP8 groups at 1
# 0.86 / 0.90x, while bf16 groups of 32 heads (168 registers, 3 resident) took 1.26 / 1.25x at 2
# (logs/idx_tune_verify_glm5_session19.md, logs/idx_tune_verify_v32_session19.md).
INDEXER_FP8_GROUP_CONFIG = replace(INDEXER_FP8_CONFIG, max_registers=None, programs_per_sm=2)
INDEXER_FP8_WIDE_GROUP_CONFIG = replace(INDEXER_FP8_GROUP_CONFIG, num_warps=8, programs_per_sm=1)
INDEXER_WIDE_GROUP_CONFIG = replace(INDEXER_CONFIG, programs_per_sm=2)
WIDE_GROUP_COLUMNS = 256
# The widest row group (next_pow2(G) x next_pow2(H) dot columns): at 1,024 the bf16 kernel needs more
# shared memory than an sm_90 block holds (299 KiB: DeepSeek-V3.2's 64 index heads at G = 16) and the FP8
# one spills 5.4 KB; 512 fits both (spilling 476 / 832 B at 64 heads and G = 8; offline sm_90 compile).
# Wider verify groups keep their rows ungrouped (group_fits).
MAX_GROUP_COLUMNS = 512
# The FP8 gather form (any slot table: each position's slot read on its own), the earlier FP8 default.
INDEXER_FP8_GATHER_CONFIG = IndexerConfig(tokens_as_m=True, num_warps=8, num_stages=6)
# The earlier kernel (heads as M, Triton's default pipelining depth, one program per SM): the
# benchmark's baseline.
INDEXER_BASELINE_CONFIG = IndexerConfig(tokens_as_m=False, num_warps=4, num_stages=3, programs_per_sm=1)


@triton.jit
def _head_sum(weighted, select, TOKENS_AS_M: tl.constexpr, ALL: tl.constexpr):
    """Per token, the sum over the selected (member, head) columns of ``weighted``
    (``[BLOCK_KV, BLOCK_C]`` when ``TOKENS_AS_M``, else ``[BLOCK_C, BLOCK_KV]``); ``ALL``: every
    column (the others hold zeros)."""
    if TOKENS_AS_M:
        if not ALL:
            weighted = tl.where(select[None, :], weighted, 0.0)
        return tl.sum(weighted, axis=1)
    else:
        if not ALL:
            weighted = tl.where(select[:, None], weighted, 0.0)
        return tl.sum(weighted, axis=0)


@triton.jit
def _indexer_logits_kernel(q_ptr, weights_ptr, k_cache_ptr, k_scale_ptr, page_table_ptr,
                           seqlens_ptr, schedule_ptr, out_ptr,
                           q_stride_row, q_stride_head, weights_stride_row, k_cache_stride,
                           k_scale_stride, page_table_stride, out_stride, num_units, num_heads,
                           out_width, skip_len, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                           GROUP_P2: tl.constexpr, HEADS_P2: tl.constexpr, BLOCK_KV: tl.constexpr,
                           TOKENS_AS_M: tl.constexpr, NUM_STAGES: tl.constexpr,
                           UPCAST: tl.constexpr, FP8: tl.constexpr, PAGE: tl.constexpr,
                           PAGE_BLOCKS: tl.constexpr, CHAINED: tl.constexpr):
    # FP8: k_cache_ptr is the e4m3 codes and k_scale_ptr the fp32 scales of a paged cache (strides
    # per page); otherwise k_cache_ptr is a bf16 [slots, HEAD_DIM] cache and k_scale_ptr unused.
    # A unit is GROUP consecutive rows sharing one page table (one row when GROUP == 1); its
    # (member, head) pairs are the columns of one dot per key block, column member * HEADS_P2 +
    # head (padding columns have zero queries and weights). PAGE_BLOCKS: block b of a row is page
    # page_table[row, 64 b] // 64 (the caller's precondition), its tokens that page's 64 slots.
    if PAGE_BLOCKS:
        tl.static_assert(BLOCK_KV == PAGE, "page_blocks needs 64-position blocks of 64-slot pages")
    enter_chain(CHAINED)
    BLOCK_C: tl.constexpr = GROUP_P2 * HEADS_P2
    sm = tl.program_id(0)
    unit = tl.load(schedule_ptr + sm * 2)
    block = tl.load(schedule_ptr + sm * 2 + 1)
    end_unit = tl.load(schedule_ptr + sm * 2 + 2)
    end_block = tl.load(schedule_ptr + sm * 2 + 3)
    cols = tl.arange(0, BLOCK_C)
    member = cols // HEADS_P2
    head = cols % HEADS_P2
    real_col = (member < GROUP) & (head < num_heads)
    members = tl.arange(0, GROUP_P2)
    dims = tl.arange(0, HEAD_DIM)
    tokens = tl.arange(0, BLOCK_KV)
    while (unit < num_units) & ((unit < end_unit) | ((unit == end_unit) & (block < end_block))):
        first_row = unit.to(tl.int64) * GROUP
        col_rows = first_row + member
        # each column's member length, 0 for members the schedule skips (never written)
        lengths = tl.load(seqlens_ptr + col_rows, mask=real_col, other=0)
        lengths = tl.where(lengths > skip_len, lengths, 0)
        unit_len = tl.max(lengths, 0)
        # a unit without blocks (the schedule's skip) may lie inside this program's share
        stop = tl.cdiv(unit_len, BLOCK_KV)
        if unit == end_unit:
            stop = tl.minimum(stop, end_block)
        q = tl.load(q_ptr + col_rows[:, None] * q_stride_row + head[:, None] * q_stride_head
                    + dims[None, :], mask=real_col[:, None], other=0.0)
        head_weights = tl.load(weights_ptr + col_rows * weights_stride_row + head, mask=real_col,
                               other=0.0)
        if FP8:
            # padding columns: zero codes, a finite scale, weight 0; on the GPU the cast to e4m3
            # rounds (the codes of the rounding under the interpreter, a -0 for +0 aside)
            q, q_scale = quantize_rows(q.to(tl.float32), True, UPCAST)
            head_weights = head_weights * q_scale
            if not UPCAST:
                q = q.to(k_cache_ptr.dtype.element_ty)
        elif UPCAST:
            q = q.to(tl.float32)
        if TOKENS_AS_M and GROUP > 1:
            # each member's length as a [1, GROUP_P2] row (0 for skipped and padding members)
            member_len = tl.load(seqlens_ptr + first_row + members, mask=members < GROUP, other=0)
            member_len = tl.where(member_len > skip_len, member_len, 0)[None, :]
        for kv_block in tl.range(block, stop, num_stages=NUM_STAGES):
            positions = kv_block * BLOCK_KV + tokens
            live = positions < unit_len
            if PAGE_BLOCKS:
                page = tl.load(page_table_ptr + first_row * page_table_stride
                               + kv_block * BLOCK_KV).to(tl.int64) // PAGE
                offset = tokens
                slots = page * PAGE + tokens
            else:
                slots = tl.load(page_table_ptr + first_row * page_table_stride + positions,
                                mask=live, other=0)
                slots = slots.to(tl.int64)
                page = slots // PAGE
                offset = slots % PAGE
            if FP8:
                key_rows = page * k_cache_stride + offset * HEAD_DIM
                key_scale = tl.load(k_scale_ptr + page * k_scale_stride + offset, mask=live,
                                    other=0.0)
            else:
                key_rows = slots * k_cache_stride
            keys = tl.load(k_cache_ptr + key_rows[:, None] + dims[None, :], mask=live[:, None],
                           other=0.0)
            if UPCAST:
                keys = keys.to(tl.float32)
            if TOKENS_AS_M:
                scores = tl.dot(keys, tl.trans(q))  # [BLOCK_KV, BLOCK_C], fp32 accumulate
                weighted = tl.maximum(scores, 0.0) * head_weights[None, :]
            else:
                scores = tl.dot(q, tl.trans(keys))  # [BLOCK_C, BLOCK_KV]
                weighted = tl.maximum(scores, 0.0) * head_weights[:, None]
            if TOKENS_AS_M and GROUP > 1:
                # every member's head sum at once: [BLOCK_KV, GROUP_P2], one 2-D store
                logits = tl.sum(tl.reshape(weighted, (BLOCK_KV, GROUP_P2, HEADS_P2)), axis=2)
                if FP8:
                    logits = logits * key_scale[:, None]
                at = positions[:, None]
                logits = tl.where(at < member_len, logits, float("-inf"))
                edge = tl.cdiv(member_len, BLOCK_KV) * BLOCK_KV
                tl.store(out_ptr + (first_row + members)[None, :] * out_stride + at, logits,
                         mask=(at < edge) & (at < out_width))
            else:
                for g in tl.static_range(GROUP):
                    if GROUP == 1:
                        length = unit_len
                    else:
                        length = tl.load(seqlens_ptr + first_row + g)
                        length = tl.where(length > skip_len, length, 0)
                    logits = _head_sum(weighted, member == g, TOKENS_AS_M, GROUP == 1)
                    if FP8:
                        logits = logits * key_scale
                    logits = tl.where(positions < length, logits, float("-inf"))
                    edge = tl.cdiv(length, BLOCK_KV) * BLOCK_KV
                    tl.store(out_ptr + (first_row + g) * out_stride + positions, logits,
                             mask=(positions < edge) & (positions < out_width))
        unit += 1
        block = 0


def indexer_logits(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                   page_table_1: torch.Tensor, seqlens: torch.Tensor, schedule: torch.Tensor,
                   out: torch.Tensor, *, skip_len: int = 0, rows_per_group: int = 1,
                   check_values: bool = True,
                   config: IndexerConfig | None = None) -> torch.Tensor:
    """Lightning-indexer logits of every scheduled query row over its live tokens.

    ``out[r, t] = sum_h weights[r, h] * relu(q[r, h] . k_cache[page_table_1[r, t]])`` for
    ``t < seqlens[r]``, fp32 accumulation of bf16 products. The scale (``softmax_scale *
    H^-0.5``) is expected folded into ``weights``.

    With an FP8 cache (DeepSeek-V3.2's ``fp8_index``): ``qc[r, h], qs[r, h] = act_quant(q[r, h])``
    (e4m3 codes, ue8m0 scale, :mod:`dsaspec.ops.e4m3`) and ``out[r, t] = ks[s] * sum_h
    weights[r, h] * qs[r, h] * relu(qc[r, h] . kc[s])`` for ``s = page_table_1[r, t]``, ``kc[s],
    ks[s]`` the slot's e4m3 codes and fp32 scale; the dot is an FP8 tensor-core dot with fp32
    accumulation. The caller rotates ``q`` and the keys (Hadamard) before, where the model does.

    Parameters
    ----------
    q : bf16 ``[R, H, 128]``, indexer queries (last dim contiguous).
    weights : fp32 ``[R, H]``, per-head weights.
    k_cache : bf16 ``[num_slots, 128]``, indexer key cache indexed by slot; or an FP8 paged
        cache, uint8 ``[pages, 8448]`` (``num_slots = 64 * pages``; slot ``s`` is token
        ``s % 64`` of page ``s // 64``, docs/fp8-kv-cache.md).
    page_table_1 : int32 ``[R, W]``, logical position -> slot; only ``[r, :seqlens[r])`` of the
        scheduled rows is read (with groups: each group's first row, up to its longest member).
        With ``config.page_blocks`` it must be page-consistent: every live 64-position block
        ``[64 b, 64 b + 64)`` holds the slots ``64 p + 0 .. 63`` of one page ``p`` (a partial
        last block their prefix), as the page allocator (:mod:`dsaspec.memory`) writes them;
        only each block's first entry is then read.
    seqlens : int32 ``[R]``, causal length of each row (``seqlens_expanded``).
    schedule : int32 ``[num_sms + 1, 2]``, from ``indexer_schedule(seqlens, num_sms, out,
        skip_len=skip_len, rows_per_group=rows_per_group)`` with the same ``seqlens``,
        ``skip_len``, ``rows_per_group`` and block 64; the grid is ``num_sms`` programs (size it by
        the configuration's ``programs_per_sm``: :func:`default_indexer_programs` for the default).
    out : fp32 ``[R, W_out]``, written for every row with ``seqlens[r] > skip_len`` at
        ``[r, t]`` for ``t < min(64 * cdiv(seqlens[r], 64), W_out)``: the logit for
        ``t < seqlens[r]``, ``-inf`` up to the 64-token block edge. Everything else is left
        untouched: rows with ``seqlens[r] <= skip_len`` are neither read nor written.
    skip_len : the schedule's ``skip_len`` (pass the top-k, whose ``topk_slots`` needs no
        logits of such rows; 0: every row). A different value cannot make a written logit
        wrong, only idle SMs or waste work.
    rows_per_group : ``G``, the schedule's. ``G > 1`` (target verify: the N rows of a request):
        rows ``[u * G, (u + 1) * G)`` must share their page-table prefix up to the longest of
        them, which is read from row ``u * G`` only, and each key block is read once for the
        ``G`` rows (one dot with ``G * H`` columns). Logits of a row then differ from ``G = 1``
        in the summation order of the head sum (not bitwise equal). A group holds at most
        :data:`MAX_GROUP_COLUMNS` columns (:func:`group_fits`, else a ``ValueError``).
    check_values : also check (a host sync, so not inside CUDA graphs) that every length fits
        ``W`` and ``W_out``, that the schedule was built for ``R / G`` units, that the rows
        of a group share their page-table prefix and that every slot read (the live prefix
        named under ``page_table_1``) is a row of ``k_cache``, ``0 <= slot < num_slots``, and
        with ``config.page_blocks`` that the read prefixes are page-consistent. Shapes, dtypes,
        devices and strides are always checked. With ``False`` (graph replay) these are
        preconditions the caller guarantees (a longer row reads past its page-table row, an
        out-of-range slot outside ``k_cache``, a block that is not one page the wrong keys).
    config : launch configuration (default: :func:`default_indexer_config`; the FP8 defaults read
        a page per block, so the table must be page-consistent); :data:`INDEXER_BASELINE_CONFIG`
        is the earlier kernel (the benchmark's baseline); :data:`INDEXER_FP8_GATHER_CONFIG` reads each position's slot on its own, for any
        table (bitwise equal logits on page-consistent tables).

    Returns
    -------
    ``out``.
    """
    _check_inputs(q, weights, k_cache, page_table_1, seqlens, schedule, out)
    if skip_len < 0:
        raise ValueError(f"skip_len: expected >= 0, got {skip_len}")
    num_rows, num_heads, head_dim = q.shape
    check_rows_per_group(rows_per_group, num_rows)
    if not group_fits(rows_per_group, num_heads):
        raise ValueError(f"rows_per_group: a group of {rows_per_group} rows of {num_heads} index heads holds "
                         f"{triton.next_power_of_2(rows_per_group) * triton.next_power_of_2(num_heads)} dot "
                         f"columns (powers of two), more than MAX_GROUP_COLUMNS = {MAX_GROUP_COLUMNS}: "
                         f"group fewer rows, or none")
    fp8 = is_fp8_cache(k_cache)
    config = config or default_indexer_config(fp8, rows_per_group, num_heads)
    if fp8:
        codes, scales = index_k_fp8_views(k_cache)
        keys, key_stride, scale_stride = codes, codes.stride(0), scales.stride(0)
    else:
        keys, scales, key_stride, scale_stride = k_cache, k_cache, k_cache.stride(0), 0
    if check_values:
        check_live_width(seqlens, page_table_1=page_table_1, out=out)
        _check_groups(page_table_1, seqlens, schedule, rows_per_group, skip_len)
        num_slots = k_cache.shape[0] * (PAGE_SIZE if fp8 else 1)
        _check_slots(page_table_1, seqlens, num_slots, rows_per_group, skip_len)
        if config.page_blocks:
            _check_pages(page_table_1, seqlens, rows_per_group, skip_len)
    group_p2 = triton.next_power_of_2(rows_per_group)
    heads_p2 = max(triton.next_power_of_2(num_heads), 16 // group_p2)  # a dot needs N >= 16
    num_programs = schedule.shape[0] - 1
    chained = supports_pdl(q.device)
    _indexer_logits_kernel[(num_programs,)](
        q, weights, keys, scales, page_table_1, seqlens, schedule, out,
        q.stride(0), q.stride(1), weights.stride(0), key_stride, scale_stride,
        page_table_1.stride(0), out.stride(0), num_rows // rows_per_group, num_heads,
        out.shape[1], skip_len,
        GROUP=rows_per_group, HEAD_DIM=head_dim, GROUP_P2=group_p2, HEADS_P2=heads_p2,
        BLOCK_KV=INDEXER_BLOCK_KV,
        TOKENS_AS_M=config.tokens_as_m, NUM_STAGES=config.num_stages, UPCAST=not q.is_cuda,
        FP8=fp8, PAGE=PAGE_SIZE, PAGE_BLOCKS=config.page_blocks, CHAINED=chained, launch_pdl=chained,
        num_warps=config.num_warps, maxnreg=config.max_registers)
    return out


def group_fits(rows_per_group: int, num_heads: int) -> bool:
    """Whether ``rows_per_group`` rows of ``num_heads`` index heads may share a group: ``next_pow2(G)
    * next_pow2(H) <= MAX_GROUP_COLUMNS`` (always at ``G = 1``)."""
    return rows_per_group == 1 or (triton.next_power_of_2(rows_per_group) * triton.next_power_of_2(num_heads)
                                   <= MAX_GROUP_COLUMNS)


def default_indexer_config(fp8: bool, rows_per_group: int, num_heads: int) -> IndexerConfig:
    """:func:`indexer_logits`' configuration when none is given. Single rows: :data:`INDEXER_CONFIG`
    on bf16 keys, :data:`INDEXER_FP8_CONFIG` on FP8 keys. Row groups whose dot has at least
    :data:`WIDE_GROUP_COLUMNS` columns (``next_pow2(G) * next_pow2(H)``):
    :data:`INDEXER_WIDE_GROUP_CONFIG` / :data:`INDEXER_FP8_WIDE_GROUP_CONFIG`; narrower groups:
    :data:`INDEXER_CONFIG` / :data:`INDEXER_FP8_GROUP_CONFIG`."""
    wide = (rows_per_group > 1 and triton.next_power_of_2(rows_per_group)
            * triton.next_power_of_2(num_heads) >= WIDE_GROUP_COLUMNS)
    if not fp8:
        return INDEXER_WIDE_GROUP_CONFIG if wide else INDEXER_CONFIG
    if rows_per_group == 1:
        return INDEXER_FP8_CONFIG
    return INDEXER_FP8_WIDE_GROUP_CONFIG if wide else INDEXER_FP8_GROUP_CONFIG


def default_indexer_programs(device: torch.device | str, fp8: bool, rows_per_group: int,
                             num_heads: int) -> int:
    """Schedule entries for :func:`default_indexer_config`'s configuration on ``device``: its
    ``programs_per_sm`` times the SM count (:func:`indexer_programs`)."""
    return indexer_programs(device, default_indexer_config(fp8, rows_per_group, num_heads).programs_per_sm)


def _check_inputs(q, weights, k_cache, page_table_1, seqlens, schedule, out) -> None:
    check_tensor("q", q, dtype=torch.bfloat16, shape=(None, None, INDEX_HEAD_DIM))
    num_rows, num_heads, _ = q.shape
    device = q.device
    check_tensor("weights", weights, dtype=torch.float32, shape=(num_rows, num_heads),
                 device=device)
    if is_fp8_cache(k_cache):
        check_tensor("k_cache", k_cache, dtype=torch.uint8, shape=(None, INDEX_FP8_PAGE_BYTES),
                     device=device)
        if k_cache.stride(0) != INDEX_FP8_PAGE_BYTES:
            raise ValueError(f"k_cache: expected contiguous FP8 pages (row stride "
                             f"{INDEX_FP8_PAGE_BYTES}), got stride {k_cache.stride(0)}")
    elif k_cache.dtype != torch.bfloat16:
        raise ValueError(f"k_cache: expected dtype torch.bfloat16 (or an FP8 paged cache, uint8 "
                         f"[pages, {INDEX_FP8_PAGE_BYTES}]), got {k_cache.dtype}")
    else:
        check_tensor("k_cache", k_cache, dtype=torch.bfloat16, shape=(None, INDEX_HEAD_DIM),
                     device=device)
    check_tensor("page_table_1", page_table_1, dtype=torch.int32, shape=(num_rows, None),
                 device=device)
    check_tensor("seqlens", seqlens, dtype=torch.int32, shape=(num_rows,), device=device)
    check_tensor("schedule", schedule, dtype=torch.int32, shape=(None, 2), device=device)
    check_tensor("out", out, dtype=torch.float32, shape=(num_rows, None), device=device)
    if num_rows > 1 and seqlens.stride(0) != 1:
        raise ValueError("seqlens: expected a contiguous tensor")
    if schedule.shape[0] < 2 or not schedule.is_contiguous():
        raise ValueError(f"schedule: expected a contiguous [num_sms + 1, 2] tensor with "
                         f"num_sms >= 1, got shape {tuple(schedule.shape)}")


def _check_groups(page_table_1, seqlens, schedule, rows_per_group, skip_len) -> None:
    """Value checks (host sync) of the unit structure: the schedule's end marker and, for groups,
    that every scheduled row's live page-table prefix equals its group's first row's."""
    num_rows = seqlens.shape[0]
    units = int(schedule[-1, 0])
    if units != num_rows // rows_per_group:
        raise ValueError(f"schedule: built for {units} units, expected R / rows_per_group = "
                         f"{num_rows // rows_per_group}; pass the schedule's rows_per_group")
    if rows_per_group == 1 or num_rows == 0:
        return
    longest = max(int(seqlens.max()), 0)
    grouped = page_table_1[:, :longest].reshape(-1, rows_per_group, longest)
    lengths = torch.where(seqlens > skip_len, seqlens, 0).view(-1, rows_per_group)
    needed = torch.arange(longest, device=seqlens.device) < lengths[:, :, None]
    differs = ((grouped != grouped[:, :1]) & needed).flatten(1).any(1)
    if bool(differs.any()):
        unit = int(differs.nonzero()[0])
        raise ValueError(f"page_table_1: rows {unit * rows_per_group}.."
                         f"{(unit + 1) * rows_per_group - 1} form a group (rows_per_group="
                         f"{rows_per_group}) but their live prefixes differ from the first row's")


def _entries_read(page_table_1, seqlens, rows_per_group, skip_len):
    """The page-table entries the kernel dereferences, ``[units, longest]`` (each unit's first row),
    and the mask of the live ones (up to the unit's longest member longer than ``skip_len``)."""
    lengths = torch.where(seqlens > skip_len, seqlens, 0).view(-1, rows_per_group).amax(1)
    longest = int(lengths.max())
    position = torch.arange(longest, device=seqlens.device)
    return page_table_1[::rows_per_group, :longest], position < lengths[:, None]


def _check_slots(page_table_1, seqlens, num_slots, rows_per_group, skip_len) -> None:
    """Value check (host sync): every page-table entry the kernel dereferences (each unit's first
    row, up to its longest member longer than ``skip_len``) is a row of ``k_cache``."""
    if seqlens.numel() == 0:
        return
    read, live = _entries_read(page_table_1, seqlens, rows_per_group, skip_len)
    bad = live & ((read < 0) | (read >= num_slots))
    if bool(bad.any()):
        unit, position = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"page_table_1: slot {int(read[unit, position])} at row "
                         f"{unit * rows_per_group}, position {position} (within the live "
                         f"length) is out of range for a k_cache of {num_slots} slots; expected "
                         f"0 <= slot < {num_slots}")


def _check_pages(page_table_1, seqlens, rows_per_group, skip_len) -> None:
    """Value check (host sync) of ``page_blocks``: every live entry of each unit's first row is
    its block's page, ``64 * (page_table_1[r, 64 b] // 64) + t % 64`` at position ``t``."""
    if seqlens.numel() == 0:
        return
    read, live = _entries_read(page_table_1, seqlens, rows_per_group, skip_len)
    position = torch.arange(read.shape[1], device=seqlens.device)
    offset = position % PAGE_SIZE
    expected = read[:, position - offset] // PAGE_SIZE * PAGE_SIZE + offset
    bad = live & (read != expected)
    if bool(bad.any()):
        unit, at = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"page_table_1: slot {int(read[unit, at])} at row {unit * rows_per_group}, "
                         f"position {at} breaks the page-granular read (config.page_blocks): "
                         f"expected slot {int(expected[unit, at])}, each live {PAGE_SIZE}-position "
                         f"block one page, slot = page * {PAGE_SIZE} + position % {PAGE_SIZE}")
