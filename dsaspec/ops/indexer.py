"""Lightning-indexer logits over each query row's live tokens, read through the page table.

``out[r, t] = sum_h weights[r, h] * relu(q[r, h] . k_cache[page_table_1[r, t]])`` for
``t < seqlens[r]``. The grid is one program per schedule entry (``num_sms``, fixed at capture);
program ``i`` walks its share of (row, 64-token block) pairs from ``dsaspec.ops.indexer_schedule``,
so the cost follows the live lengths and never the page-table width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaspec.ops.checks import check_live_width, check_tensor
from dsaspec.ops.indexer_schedule import INDEXER_BLOCK_KV

INDEX_HEAD_DIM = 128


@triton.jit
def _indexer_logits_kernel(q_ptr, weights_ptr, k_cache_ptr, page_table_ptr, seqlens_ptr,
                           schedule_ptr, out_ptr,
                           q_stride_row, q_stride_head, weights_stride_row, k_cache_stride,
                           page_table_stride, out_stride, num_rows, num_heads, out_width,
                           HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr,
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
        stop = tl.cdiv(seqlen, BLOCK_KV)
        if row == end_row:
            stop = tl.minimum(stop, end_block)
        q = tl.load(q_ptr + row64 * q_stride_row + heads[:, None] * q_stride_head + dims[None, :],
                    mask=real_head[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        head_weights = tl.load(weights_ptr + row64 * weights_stride_row + heads,
                               mask=real_head, other=0.0)
        for kv_block in range(block, stop):
            positions = kv_block * BLOCK_KV + tokens
            live = positions < seqlen
            slots = tl.load(page_table_ptr + row64 * page_table_stride + positions,
                            mask=live, other=0)
            keys = tl.load(k_cache_ptr + slots.to(tl.int64)[:, None] * k_cache_stride
                           + dims[None, :], mask=live[:, None], other=0.0)
            if UPCAST:
                keys = keys.to(tl.float32)
            scores = tl.dot(q, tl.trans(keys))  # [BLOCK_H, BLOCK_KV], fp32 accumulate
            logits = tl.sum(tl.maximum(scores, 0.0) * head_weights[:, None], axis=0)
            logits = tl.where(live, logits, float("-inf"))
            tl.store(out_ptr + row64 * out_stride + positions, logits, mask=positions < out_width)
        row += 1
        block = 0


def indexer_logits(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                   page_table_1: torch.Tensor, seqlens: torch.Tensor, schedule: torch.Tensor,
                   out: torch.Tensor, check_values: bool = True) -> torch.Tensor:
    """Lightning-indexer logits of every query row over its live tokens.

    ``out[r, t] = sum_h weights[r, h] * relu(q[r, h] . k_cache[page_table_1[r, t]])`` for
    ``t < seqlens[r]``, fp32 accumulation of bf16 products. The scale (``softmax_scale *
    H^-0.5``) is expected folded into ``weights``.

    Parameters
    ----------
    q : bf16 ``[R, H, 128]``, indexer queries (last dim contiguous).
    weights : fp32 ``[R, H]``, per-head weights.
    k_cache : bf16 ``[num_slots, 128]``, indexer key cache indexed by slot.
    page_table_1 : int32 ``[R, W]``, logical position -> slot; only ``[r, :seqlens[r])`` is read.
    seqlens : int32 ``[R]``, causal length of each row (``seqlens_expanded``).
    schedule : int32 ``[num_sms + 1, 2]``, from ``indexer_schedule(seqlens, num_sms, ...)`` with
        the same ``seqlens`` and block 64; the grid is ``num_sms`` programs.
    out : fp32 ``[R, W_out]``, written at ``[r, t]`` for ``t < min(64 * cdiv(seqlens[r], 64),
        W_out)``: the logit for ``t < seqlens[r]``, ``-inf`` up to the 64-token block edge.
        Everything beyond is left untouched.
    check_values : validate shapes, dtypes, devices and (host sync) the lengths against ``W`` and
        ``W_out``. Pass ``False`` inside CUDA graphs.

    Returns
    -------
    ``out``.
    """
    if check_values:
        _check_inputs(q, weights, k_cache, page_table_1, seqlens, schedule, out)
    num_rows, num_heads, head_dim = q.shape
    block_h = max(16, triton.next_power_of_2(num_heads))
    num_programs = schedule.shape[0] - 1
    _indexer_logits_kernel[(num_programs,)](
        q, weights, k_cache, page_table_1, seqlens, schedule, out,
        q.stride(0), q.stride(1), weights.stride(0), k_cache.stride(0), page_table_1.stride(0),
        out.stride(0), num_rows, num_heads, out.shape[1],
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_KV=INDEXER_BLOCK_KV, UPCAST=not q.is_cuda,
        num_warps=4)
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
    check_live_width(seqlens, page_table_1=page_table_1, out=out)
