"""Live-bounded DSA replay metadata: bit-identical to ``dsa_metadata`` on the contract region, at a
cost that follows the live KV length instead of the configured context.

Grid ``1 + B * splits`` with ``splits = max(1, min(budget // B, 256))``: it depends only on the
batch bucket and the budget, never on lengths, so one captured launch replays with any lengths.
Program 0 writes the 1-D outputs; program ``1 + b * splits + split`` strides over request ``b``'s
tile-rounded live prefix ``[0, min(roundup(live, 128), W))`` in blocks of ``BLOCK_COLS`` columns
(``block = split, split + splits, ...``), reads each block of ``req_to_token`` once and writes it to every metadata row of the request (N rows for
target verify and draft extend) in every destination buffer set (up to four per launch: the MTP
draft step backends). Columns past the tile-rounded live prefix are never written, so they keep
whatever an earlier replay left there (valid slot ids; consumers never read them).

Why one program group per request instead of per row (the context-wide kernel launches per row): a request's N
verify rows share one ``req_to_token`` row, so reading it once and writing it N times moves
1 + N units of traffic per tile instead of 2N.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from dsaspec import flags
from dsaspec.ops.dsa_metadata_common import (MODE_DECODE, MODE_EXTEND_VARIABLE, MODE_VERIFY, TILE,
                                             MetadataBuffers, Mode, extend_prefix, launch_shape,
                                             mode_code, page_starts, store_tile, validate_inputs,
                                             write_lengths)

MAX_SPLITS = 256
MAX_DESTINATIONS = 4
BLOCK_COLS = 128  # columns moved per program step (H200 sweep: scripts/tune_metadata.py)
NUM_WARPS = 4


def num_splits(batch: int, budget: int) -> int:
    """Programs per request: ``max(1, min(budget // batch, 256))``."""
    return max(1, min(budget // batch, MAX_SPLITS))


@triton.jit
def _store_all(vals, cols, col_mask, real_vals, real_cols, real_mask, row, pt0, real0, pt1, real1,
               pt2, real2, pt3, real3, stride_pt, stride_real, HAS_REAL: tl.constexpr,
               NUM_DEST: tl.constexpr):
    store_tile(vals, cols, col_mask, real_vals, real_cols, real_mask, row, pt0, real0, stride_pt,
               stride_real, HAS_REAL)
    if NUM_DEST > 1:
        store_tile(vals, cols, col_mask, real_vals, real_cols, real_mask, row, pt1, real1, stride_pt,
                   stride_real, HAS_REAL)
    if NUM_DEST > 2:
        store_tile(vals, cols, col_mask, real_vals, real_cols, real_mask, row, pt2, real2, stride_pt,
                   stride_real, HAS_REAL)
    if NUM_DEST > 3:
        store_tile(vals, cols, col_mask, real_vals, real_cols, real_mask, row, pt3, real3, stride_pt,
                   stride_real, HAS_REAL)


@triton.jit(do_not_specialize=["W"])
def _bounded_kernel(req_to_token_ptr, stride_pool, req_pool_ptr, seq_lens_ptr, ext_ptr,
                    len0, pt0, real0, len1, pt1, real1, len2, pt2, real2, len3, pt3, real3,
                    off_cu, off_exp, off_dsa, off_dsacu,
                    B, R, N, K, W, stride_pt, stride_real, SPLITS,
                    MODE: tl.constexpr, HAS_REAL: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    NUM_DEST: tl.constexpr,
                    BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr, TILE_W: tl.constexpr,
                    BLOCK_COLS: tl.constexpr):
    pid = tl.program_id(0)
    if pid == 0:
        write_lengths(seq_lens_ptr, ext_ptr, len0, off_cu, off_exp, off_dsa, off_dsacu,
                      B, R, N, K, MODE, BLOCK_B, BLOCK_R)
        if NUM_DEST > 1:
            write_lengths(seq_lens_ptr, ext_ptr, len1, off_cu, off_exp, off_dsa, off_dsacu,
                          B, R, N, K, MODE, BLOCK_B, BLOCK_R)
        if NUM_DEST > 2:
            write_lengths(seq_lens_ptr, ext_ptr, len2, off_cu, off_exp, off_dsa, off_dsacu,
                          B, R, N, K, MODE, BLOCK_B, BLOCK_R)
        if NUM_DEST > 3:
            write_lengths(seq_lens_ptr, ext_ptr, len3, off_cu, off_exp, off_dsa, off_dsacu,
                          B, R, N, K, MODE, BLOCK_B, BLOCK_R)
    else:
        idx = pid - 1
        b = idx // SPLITS
        split = idx % SPLITS
        live = tl.load(seq_lens_ptr + b).to(tl.int32)
        if MODE == MODE_VERIFY:
            live = live + N
        if MODE == MODE_DECODE:
            first = b
            count = 1
        elif MODE == MODE_EXTEND_VARIABLE:
            lanes, ext, starts, _ = extend_prefix(ext_ptr, B, BLOCK_B)
            first = tl.sum(tl.where(lanes == b, starts, 0), axis=0)
            # Rows past R (sum(extend_seq_lens) > rows, a violated precondition) are dropped.
            count = tl.minimum(tl.sum(tl.where(lanes == b, ext, 0), axis=0), tl.maximum(R - first, 0))
        else:
            first = b * N
            count = N
        pool = tl.load(req_pool_ptr + b).to(tl.int64)
        src = req_to_token_ptr + pool * stride_pool
        end = tl.minimum(tl.cdiv(live, TILE_W) * TILE_W, W)  # tile-rounded live prefix
        for block in tl.range(split, tl.cdiv(end, BLOCK_COLS), SPLITS):
            cols = block * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
            col_mask = cols < end
            vals = tl.load(src + cols, mask=col_mask, other=0)
            # Once per block, not per row: the real-table values are the same for all N rows.
            real_vals, real_cols, real_mask = page_starts(vals, cols, col_mask, PAGE_SIZE)
            for j in tl.range(0, count):
                _store_all(vals, cols, col_mask, real_vals, real_cols, real_mask, first + j, pt0, real0,
                           pt1, real1, pt2, real2, pt3, real3, stride_pt, stride_real, HAS_REAL, NUM_DEST)


def bounded_metadata(mode: Mode, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, out: MetadataBuffers | Sequence[MetadataBuffers], *,
                     index_topk: int, page_size: int, num_draft_tokens: int = 1,
                     extend_seq_lens: torch.Tensor | None = None, budget: int | None = None,
                     block_cols: int = BLOCK_COLS, num_warps: int = NUM_WARPS, check: bool = True) -> None:
    """Write the replay metadata of ``mode`` into ``out`` over each row's live prefix only.

    Same math and arguments as :func:`dsaspec.ops.dsa_metadata.context_wide_metadata`; ``out`` may
    be several buffer sets of identical layout (the MTP draft step backends), written by one launch
    per four sets. Writes every 1-D output in full, ``page_table_1[row, :min(roundup(live, 128), W))``
    and the real-table columns of those tiles (``live = s``, or ``s + N`` for target verify).
    ``budget`` (default ``flags.metadata_program_budget()``) caps the programs per launch:
    ``1 + B * max(1, min(budget // B, 256))``. Preconditions checked only when ``check`` (they
    need a host sync): pool indices in range, ``0 <= s (+N) <= W``, ``sum(extend_seq_lens) == rows``.
    ``block_cols`` (a power of two >= 128) is how many columns one program moves per step and
    ``num_warps`` its warps (tuning knobs, defaults measured on an H200); the written region does
    not depend on them.
    """
    mode = Mode(mode)
    outs = [out] if isinstance(out, MetadataBuffers) else list(out)
    validate_inputs(mode, req_to_token, req_pool_indices, seq_lens, outs, index_topk=index_topk,
                    page_size=page_size, num_draft_tokens=num_draft_tokens,
                    extend_seq_lens=extend_seq_lens, check=check)
    budget = flags.metadata_program_budget() if budget is None else budget
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if block_cols < TILE or block_cols & (block_cols - 1):
        raise ValueError(f"block_cols must be a power of two >= {TILE}, got {block_cols}")
    B, R, W = outs[0].batch, outs[0].rows, req_to_token.shape[1]
    splits = num_splits(B, budget)
    block_b, block_r = launch_shape(B, R)
    has_real = outs[0].real_page_table is not None
    stride_real = outs[0].real_page_table.stride(0) if has_real else 0
    code = mode_code(mode, extend_seq_lens is not None)
    ext = extend_seq_lens if extend_seq_lens is not None else seq_lens
    for start in range(0, len(outs), MAX_DESTINATIONS):
        group = outs[start:start + MAX_DESTINATIONS]
        dests = []
        for o in group + [group[0]] * (MAX_DESTINATIONS - len(group)):
            dests += [o.lengths, o.page_table_1, o.real_page_table if has_real else o.page_table_1]
        _bounded_kernel[(1 + B * splits,)](
            req_to_token, req_to_token.stride(0), req_pool_indices, seq_lens, ext, *dests,
            *outs[0].length_offsets(), B, R, num_draft_tokens, index_topk, W,
            outs[0].page_table_1.stride(0), stride_real, splits, MODE=code, HAS_REAL=has_real,
            PAGE_SIZE=page_size, NUM_DEST=len(group),
            BLOCK_B=block_b, BLOCK_R=block_r, TILE_W=TILE,
            BLOCK_COLS=block_cols, num_warps=num_warps)
