"""Exact top-k over ragged live lengths, mapped through the page table to KV slots.

One program per row. Logits become order-preserving uint32 keys; a radix select (8-bit digits,
most significant first, one histogram pass over the live range per digit, stopping early once the
threshold bin holds exactly the entries still needed) finds the k-th largest key; one last pass
writes the selected positions' slots in ascending position order. Every pass reads only
``logits[r, :seqlens[r]]``, so the cost follows the live length. A row no longer than ``k``
(sparse == dense) takes every live position: one pass copies its slots and reads no logit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaspec.ops.checks import check_live_width, check_tensor

_GPU_BLOCK = 4096  # logits per loop step on the GPU
_CPU_BLOCK = 128  # small under the interpreter, so short test rows still take several steps


@triton.jit
def _order_key(values):
    """uint32 keys with the order of the fp32 ``values`` (by bit pattern: -0.0 below +0.0,
    NaNs with the sign bit below -inf, the others above +inf)."""
    bits = values.to(tl.int32, bitcast=True)
    flip = (bits >> 31) | -2147483648  # negative: flip every bit; positive: only the sign bit
    return (bits ^ flip).to(tl.uint32, bitcast=True)


@triton.jit
def _topk_slots_kernel(logits_ptr, seqlens_ptr, page_table_ptr, out_ptr, positions_ptr,
                       logits_stride, page_table_stride, out_stride, positions_stride, k,
                       copy_len, WRITE_POSITIONS: tl.constexpr, BLOCK: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    live = tl.maximum(tl.load(seqlens_ptr + row), 0)
    offsets = tl.arange(0, BLOCK)
    row_logits = logits_ptr + row * logits_stride
    row_table = page_table_ptr + row * page_table_stride
    row_out = out_ptr + row * out_stride
    row_positions = positions_ptr + row * positions_stride
    if live <= copy_len:
        # every live position is selected (copy_len <= k): copy the slots, read no logit
        for start in range(0, live, BLOCK):
            positions = start + offsets
            in_row = positions < live
            tl.store(row_out + positions, tl.load(row_table + positions, mask=in_row),
                     mask=in_row)
            if WRITE_POSITIONS:
                tl.store(row_positions + positions, positions, mask=in_row)
        written = live
    else:
        written = _select_and_write(row_logits, row_table, row_out, row_positions, live, k,
                                    WRITE_POSITIONS, BLOCK)
    for start in range(written // BLOCK_K * BLOCK_K, k, BLOCK_K):
        index = start + tl.arange(0, BLOCK_K)
        empty = (index >= written) & (index < k)
        tl.store(row_out + index, -1, mask=empty)
        if WRITE_POSITIONS:
            tl.store(row_positions + index, -1, mask=empty)


@triton.jit
def _select_and_write(row_logits, row_table, row_out, row_positions, live, k,
                      WRITE_POSITIONS: tl.constexpr, BLOCK: tl.constexpr):
    """Radix-select the row's top ``min(live, k)`` and write their slots (and positions) in
    ascending position order; returns how many were written."""
    offsets = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    # Selection rule: (key >> shift) > threshold, or == threshold for the first `need` such
    # positions. With live <= k the rule (shift 0, threshold 0, need k) takes every position.
    threshold = tl.zeros((), dtype=tl.uint32)
    shift = tl.zeros((), dtype=tl.uint32)
    need = tl.zeros((), dtype=tl.int32) + k  # a tensor even when k is specialised to a constant
    searching = live > k
    for level in tl.static_range(4):
        if searching:
            histogram = tl.zeros((256,), dtype=tl.int32)
            for start in range(0, live, BLOCK):
                positions = start + offsets
                in_row = positions < live
                keys = _order_key(tl.load(row_logits + positions, mask=in_row, other=0.0))
                if level > 0:
                    in_row = in_row & ((keys >> (32 - 8 * level)) == threshold)
                digits = ((keys >> (24 - 8 * level)) & 255).to(tl.int32)
                histogram += tl.histogram(digits, 256, mask=in_row)
            # at_or_above[b] = entries whose digit is >= b; the threshold digit is the largest b
            # that still reaches `need`
            at_or_above = tl.sum(histogram, 0) - tl.cumsum(histogram, 0) + histogram
            digit = tl.max(tl.where(at_or_above >= need, bins, -1), 0)
            in_digit = tl.sum(tl.where(bins == digit, histogram, 0), 0)
            need -= tl.sum(tl.where(bins == digit, at_or_above, 0), 0) - in_digit
            threshold = (threshold << 8) | digit.to(tl.uint32)
            shift = tl.full((), 24 - 8 * level, dtype=tl.uint32)
            searching = in_digit != need

    written = tl.zeros((), dtype=tl.int32)
    ties_seen = tl.zeros((), dtype=tl.int32)
    for start in range(0, live, BLOCK):
        positions = start + offsets
        in_row = positions < live
        keys = _order_key(tl.load(row_logits + positions, mask=in_row, other=0.0)) >> shift
        above = in_row & (keys > threshold)
        tie = in_row & (keys == threshold)
        tie_rank = ties_seen + tl.cumsum(tie.to(tl.int32), 0) - 1
        selected = above | (tie & (tie_rank < need))
        index = written + tl.cumsum(selected.to(tl.int32), 0) - 1
        slots = tl.load(row_table + positions, mask=selected, other=-1)
        tl.store(row_out + index, slots, mask=selected)
        if WRITE_POSITIONS:
            tl.store(row_positions + index, positions, mask=selected)
        written += tl.sum(selected.to(tl.int32), 0)
        ties_seen += tl.sum(tie.to(tl.int32), 0)
    return written


def topk_slots(logits: torch.Tensor, seqlens: torch.Tensor, page_table_1: torch.Tensor, k: int,
               out: torch.Tensor, *, check_values: bool = True,
               out_positions: torch.Tensor | None = None,
               read_short_rows: bool = False) -> torch.Tensor:
    """Exact per-row top-k of the live logits, mapped to KV slots.

    For row ``r``: ``S_r`` = the ``min(seqlens[r], k)`` positions ``t < seqlens[r]`` with the
    largest ``logits[r, t]``; ``out[r]`` = ``page_table_1[r, t]`` for ``t`` in ``S_r`` in
    ascending ``t``, then ``-1``. Ties at the k-th value go to the lowest positions, so the
    result is deterministic. Comparison is by the fp32 bit pattern's order (``-0.0 < +0.0``;
    NaNs with the sign bit clear rank above ``+inf``, with it set below ``-inf``). A row with
    ``seqlens[r] <= k`` selects every live position, so its logits are never read (they may be
    unwritten: ``indexer_schedule(..., skip_len=k)`` skips such rows).

    Parameters
    ----------
    logits : fp32 ``[R, W_out]``; only ``[r, :seqlens[r]]`` of rows with ``seqlens[r] > k`` is
        read (last dim contiguous).
    seqlens : int32 ``[R]``, live length of each row; negative counts as 0.
    page_table_1 : int32 ``[R, W]``, logical position -> slot; only selected entries are read.
    k : number of entries per row, >= 1.
    out : int32 ``[R, k]``, written (every entry).
    check_values : also check (a host sync, so not inside CUDA graphs) that every length fits
        ``W_out`` and ``W``. Shapes, dtypes, devices and strides are always checked. With
        ``False`` the caller guarantees ``seqlens[r] <= min(W_out, W)``.
    out_positions : optional int32 ``[R, k]``, written with the logical positions (``-1`` past
        the selection) in the same order as ``out``.
    read_short_rows : run rows with ``seqlens[r] <= k`` through the selection passes too, reading
        their logits (same result; the earlier kernel, kept as the benchmark's baseline).

    Returns
    -------
    ``out``. Grid ``(R,)``; one program per row walks the live range at most five times (once,
    without reading logits, when ``seqlens[r] <= k``).
    """
    _check_inputs(logits, seqlens, page_table_1, k, out, out_positions)
    if check_values:
        check_live_width(seqlens, logits=logits, page_table_1=page_table_1)
    write_positions = out_positions is not None
    positions = out_positions if write_positions else out
    block = _GPU_BLOCK if logits.is_cuda else _CPU_BLOCK
    _topk_slots_kernel[(logits.shape[0],)](
        logits, seqlens, page_table_1, out, positions,
        logits.stride(0), page_table_1.stride(0), out.stride(0), positions.stride(0), k,
        -1 if read_short_rows else k, WRITE_POSITIONS=write_positions, BLOCK=block,
        BLOCK_K=min(block, triton.next_power_of_2(k)), num_warps=8 if logits.is_cuda else 4)
    return out


def _check_inputs(logits, seqlens, page_table_1, k, out, out_positions) -> None:
    if k < 1:
        raise ValueError(f"k: expected >= 1, got {k}")
    check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    num_rows = logits.shape[0]
    device = logits.device
    check_tensor("seqlens", seqlens, dtype=torch.int32, shape=(num_rows,), device=device)
    check_tensor("page_table_1", page_table_1, dtype=torch.int32, shape=(num_rows, None),
                 device=device)
    if num_rows > 1 and seqlens.stride(0) != 1:
        raise ValueError("seqlens: expected a contiguous tensor")
    check_tensor("out", out, dtype=torch.int32, shape=(num_rows, k), device=device)
    if out_positions is not None:
        check_tensor("out_positions", out_positions, dtype=torch.int32, shape=(num_rows, k),
                     device=device)
