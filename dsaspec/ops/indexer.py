"""Lightning-indexer logits over each query row's live tokens, read through the page table.

``out[r, t] = sum_h weights[r, h] * relu(q[r, h] . k_cache[page_table_1[r, t]])`` for
``t < seqlens[r]``. The grid is one program per schedule entry (``num_sms``, fixed at capture);
program ``i`` walks its share of (row, 64-token block) pairs from ``dsaspec.ops.indexer_schedule``,
so the cost follows the live lengths and never the page-table width, and rows the schedule skips
(``skip_len``) cost nothing. Per block: gather the 64 keys (software-pipelined over the row's
blocks), one tensor-core dot with the block's tokens as the M dimension against the row's heads
(loaded once per row), ReLU, the weighted sum over heads (docs/dsa-kernels.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsaspec.ops.checks import check_live_width, check_tensor
from dsaspec.ops.indexer_schedule import INDEXER_BLOCK_KV

INDEX_HEAD_DIM = 128


@dataclass(frozen=True)
class IndexerConfig:
    """Launch configuration of :func:`indexer_logits` (the result does not depend on it beyond
    fp32 summation order).

    tokens_as_m : the dot's M dimension is the block's 64 tokens (``keys @ q^T``, one Hopper
        warpgroup MMA per block, the head sum stays within a thread quad) instead of the heads.
    num_warps : warps per program.
    num_stages : software-pipelining depth of the loop over a row's blocks (key gathers in
        flight ahead of the dot).
    """

    tokens_as_m: bool
    num_warps: int
    num_stages: int


INDEXER_CONFIG = IndexerConfig(tokens_as_m=True, num_warps=4, num_stages=3)
# The earlier kernel (heads as M, Triton's default pipelining depth): the benchmark's baseline.
INDEXER_BASELINE_CONFIG = IndexerConfig(tokens_as_m=False, num_warps=4, num_stages=3)


@triton.jit
def _indexer_logits_kernel(q_ptr, weights_ptr, k_cache_ptr, page_table_ptr, seqlens_ptr,
                           schedule_ptr, out_ptr,
                           q_stride_row, q_stride_head, weights_stride_row, k_cache_stride,
                           page_table_stride, out_stride, num_rows, num_heads, out_width,
                           skip_len, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr,
                           TOKENS_AS_M: tl.constexpr, NUM_STAGES: tl.constexpr,
                           UPCAST: tl.constexpr):
    sm = tl.program_id(0)
    row = tl.load(schedule_ptr + sm * 2)
    block = tl.load(schedule_ptr + sm * 2 + 1)
    end_row = tl.load(schedule_ptr + sm * 2 + 2)
    end_block = tl.load(schedule_ptr + sm * 2 + 3)
    heads = tl.arange(0, BLOCK_H)
    real_head = heads < num_heads
    dims = tl.arange(0, HEAD_DIM)
    tokens = tl.arange(0, BLOCK_KV)
    while (row < num_rows) & ((row < end_row) | ((row == end_row) & (block < end_block))):
        row64 = row.to(tl.int64)
        seqlen = tl.load(seqlens_ptr + row)
        # a row without blocks (the schedule's skip) may lie inside this program's share
        stop = tl.where(seqlen > skip_len, tl.cdiv(seqlen, BLOCK_KV), 0)
        if row == end_row:
            stop = tl.minimum(stop, end_block)
        q = tl.load(q_ptr + row64 * q_stride_row + heads[:, None] * q_stride_head + dims[None, :],
                    mask=real_head[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        head_weights = tl.load(weights_ptr + row64 * weights_stride_row + heads,
                               mask=real_head, other=0.0)
        for kv_block in tl.range(block, stop, num_stages=NUM_STAGES):
            positions = kv_block * BLOCK_KV + tokens
            live = positions < seqlen
            slots = tl.load(page_table_ptr + row64 * page_table_stride + positions,
                            mask=live, other=0)
            keys = tl.load(k_cache_ptr + slots.to(tl.int64)[:, None] * k_cache_stride
                           + dims[None, :], mask=live[:, None], other=0.0)
            if UPCAST:
                keys = keys.to(tl.float32)
            if TOKENS_AS_M:
                scores = tl.dot(keys, tl.trans(q))  # [BLOCK_KV, BLOCK_H], fp32 accumulate
                logits = tl.sum(tl.maximum(scores, 0.0) * head_weights[None, :], axis=1)
            else:
                scores = tl.dot(q, tl.trans(keys))  # [BLOCK_H, BLOCK_KV]
                logits = tl.sum(tl.maximum(scores, 0.0) * head_weights[:, None], axis=0)
            logits = tl.where(live, logits, float("-inf"))
            tl.store(out_ptr + row64 * out_stride + positions, logits, mask=positions < out_width)
        row += 1
        block = 0


def indexer_logits(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                   page_table_1: torch.Tensor, seqlens: torch.Tensor, schedule: torch.Tensor,
                   out: torch.Tensor, *, skip_len: int = 0, check_values: bool = True,
                   config: IndexerConfig = INDEXER_CONFIG) -> torch.Tensor:
    """Lightning-indexer logits of every scheduled query row over its live tokens.

    ``out[r, t] = sum_h weights[r, h] * relu(q[r, h] . k_cache[page_table_1[r, t]])`` for
    ``t < seqlens[r]``, fp32 accumulation of bf16 products. The scale (``softmax_scale *
    H^-0.5``) is expected folded into ``weights``.

    Parameters
    ----------
    q : bf16 ``[R, H, 128]``, indexer queries (last dim contiguous).
    weights : fp32 ``[R, H]``, per-head weights.
    k_cache : bf16 ``[num_slots, 128]``, indexer key cache indexed by slot.
    page_table_1 : int32 ``[R, W]``, logical position -> slot; only ``[r, :seqlens[r])`` of the
        scheduled rows is read.
    seqlens : int32 ``[R]``, causal length of each row (``seqlens_expanded``).
    schedule : int32 ``[num_sms + 1, 2]``, from ``indexer_schedule(seqlens, num_sms, out,
        skip_len=skip_len)`` with the same ``seqlens``, ``skip_len`` and block 64; the grid is
        ``num_sms`` programs.
    out : fp32 ``[R, W_out]``, written for every row with ``seqlens[r] > skip_len`` at
        ``[r, t]`` for ``t < min(64 * cdiv(seqlens[r], 64), W_out)``: the logit for
        ``t < seqlens[r]``, ``-inf`` up to the 64-token block edge. Everything else is left
        untouched: rows with ``seqlens[r] <= skip_len`` are neither read nor written.
    skip_len : the schedule's ``skip_len`` (pass the top-k, whose ``topk_slots`` needs no
        logits of such rows; 0: every row). A different value cannot make a written logit
        wrong, only idle SMs or waste work.
    check_values : also check (a host sync, so not inside CUDA graphs) that every length fits
        ``W`` and ``W_out``. Shapes, dtypes, devices and strides are always checked. With
        ``False`` a longer row reads past its page-table row: the caller guarantees
        ``seqlens[r] <= min(W, W_out)``.
    config : launch configuration; :data:`INDEXER_BASELINE_CONFIG` is the earlier
        kernel (the benchmark's baseline).

    Returns
    -------
    ``out``.
    """
    _check_inputs(q, weights, k_cache, page_table_1, seqlens, schedule, out)
    if skip_len < 0:
        raise ValueError(f"skip_len: expected >= 0, got {skip_len}")
    if check_values:
        check_live_width(seqlens, page_table_1=page_table_1, out=out)
    num_rows, num_heads, head_dim = q.shape
    block_h = max(16, triton.next_power_of_2(num_heads))
    num_programs = schedule.shape[0] - 1
    _indexer_logits_kernel[(num_programs,)](
        q, weights, k_cache, page_table_1, seqlens, schedule, out,
        q.stride(0), q.stride(1), weights.stride(0), k_cache.stride(0), page_table_1.stride(0),
        out.stride(0), num_rows, num_heads, out.shape[1], skip_len,
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_KV=INDEXER_BLOCK_KV,
        TOKENS_AS_M=config.tokens_as_m, NUM_STAGES=config.num_stages, UPCAST=not q.is_cuda,
        num_warps=config.num_warps)
    return out


def _check_inputs(q, weights, k_cache, page_table_1, seqlens, schedule, out) -> None:
    check_tensor("q", q, dtype=torch.bfloat16, shape=(None, None, INDEX_HEAD_DIM))
    num_rows, num_heads, _ = q.shape
    device = q.device
    check_tensor("weights", weights, dtype=torch.float32, shape=(num_rows, num_heads),
                 device=device)
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
