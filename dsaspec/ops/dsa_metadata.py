"""Live-bounded DSA replay metadata: bit-identical to ``dsa_metadata`` on the contract region, at a
cost that follows the live KV length instead of the configured context.

Grid ``1 + B * splits`` with ``splits = max(1, min(budget // B, 256))``: it depends only on the
batch bucket and the budget, never on lengths, so one captured launch replays with any lengths.
Program 0 computes the 1-D outputs once and stores them into every destination; program
``1 + b * splits + split`` strides over request ``b``'s tile-rounded live prefix
``[0, min(roundup(live, 128), W))`` in blocks of ``BLOCK_COLS`` columns (``block = split,
split + splits, ...``), reads each block of ``req_to_token`` once and writes it to every metadata
row of the request (N rows for target verify and draft extend) in every destination buffer set (up
to four per launch: the MTP draft step backends). Columns past the tile-rounded live prefix are
never written, so they keep whatever an earlier replay left there (valid slot ids; consumers never
read them).

Why one program group per request instead of per row (the context-wide kernel launches per row):
a request's N verify rows share one ``req_to_token`` row, so reading it once and writing it N
times moves 1 + N units of traffic per tile instead of 2N.

Memory access: blocks that lie wholly inside the prefix are moved without masks, so when rows are
16-byte aligned (``vector_width``: the kernel then promises Triton 4-column alignment) and a
thread holds 4+ columns (``BLOCK_COLS >= 128 * num_warps``) loads and stores are 16-byte vectors;
only the last, partial block is masked. The real-table entries of a block (its page starts) are
loaded as one compact vector of ``cdiv(BLOCK_COLS, P)`` columns instead of masking a
``BLOCK_COLS``-wide store down to a few lanes.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from dsaspec.ops.dsa_metadata_common import (MODE_VERIFY, TILE, MetadataBuffers, launch_shape, mode_code,
                                             request_rows, store_all, validate_inputs, vector_width,
                                             write_lengths)
from dsaspec.forward_mode import Mode

MAX_SPLITS = 256
MAX_DESTINATIONS = 4
BLOCK_COLS = 128  # columns moved per program step (H200 sweep: scripts/tune_metadata.py)
NUM_WARPS = 4


DEFAULT_BUDGET = 2048  # programs per launch of the bounded kernels


def num_splits(batch: int, budget: int) -> int:
    """Programs per request: ``max(1, min(budget // batch, 256))``."""
    return max(1, min(budget // batch, MAX_SPLITS))


@triton.jit
def _store(ptr, offs, vals, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, vals, mask=mask)
    else:
        tl.store(ptr + offs, vals)


@triton.jit
def _copy_block(src, block, end, first, count, pt0, real0, pt1, real1, pt2, real2, pt3, real3,
                stride_pt, stride_real, HAS_REAL: tl.constexpr, PAGE_SIZE: tl.constexpr,
                NUM_DEST: tl.constexpr, BLOCK_COLS: tl.constexpr, REAL_BLOCK: tl.constexpr,
                DST_VEC: tl.constexpr, MASKED: tl.constexpr):
    """Read columns ``[block * BLOCK_COLS, +BLOCK_COLS) ∩ [0, end)`` of the source row once and
    write them (and their page starts // P) into rows ``first .. first + count - 1`` of every
    destination. ``MASKED=False``: the whole block lies below ``end``."""
    cols = block * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < end
    if MASKED:
        vals = tl.load(src + cols, mask=col_mask, other=0)
    else:
        vals = tl.load(src + cols)
    if HAS_REAL:
        # Page starts c * P inside this block and below end, loaded compactly (same cache lines).
        real_cols = tl.cdiv(block * BLOCK_COLS, PAGE_SIZE) + tl.arange(0, REAL_BLOCK)
        real_src = real_cols * PAGE_SIZE
        real_mask = (real_src < block * BLOCK_COLS + BLOCK_COLS) & (real_src < end)
        real_vals = tl.load(src + real_src, mask=real_mask, other=0) // PAGE_SIZE
    for j in tl.range(0, count):
        row64 = (first + j).to(tl.int64)
        pt_off = tl.multiple_of(row64 * stride_pt, DST_VEC)
        _store(pt0, pt_off + cols, vals, col_mask, MASKED)
        if NUM_DEST > 1:
            _store(pt1, pt_off + cols, vals, col_mask, MASKED)
        if NUM_DEST > 2:
            _store(pt2, pt_off + cols, vals, col_mask, MASKED)
        if NUM_DEST > 3:
            _store(pt3, pt_off + cols, vals, col_mask, MASKED)
        if HAS_REAL:
            store_all(row64 * stride_real + real_cols, real_vals, real_mask, real0, real1, real2, real3, NUM_DEST)


# Sizes that differ per batch bucket are not specialised: fewer compiled variants per server.
@triton.jit(do_not_specialize=["B", "R", "W", "POOL", "LENGTH_PROGRAMS", "SPLITS"])
def _bounded_kernel(req_to_token_ptr, stride_pool, req_pool_ptr, seq_lens_ptr, ext_ptr,
                    len0, pt0, real0, len1, pt1, real1, len2, pt2, real2, len3, pt3, real3,
                    off_cu, off_exp, off_dsa, off_dsacu,
                    B, R, N, K, W, POOL, stride_pt, stride_real, SPLITS, LENGTH_PROGRAMS,
                    MODE: tl.constexpr, HAS_REAL: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    NUM_DEST: tl.constexpr, BLOCK_B: tl.constexpr, CHUNK_R: tl.constexpr,
                    TILE_W: tl.constexpr, BLOCK_COLS: tl.constexpr, REAL_BLOCK: tl.constexpr,
                    SRC_VEC: tl.constexpr, DST_VEC: tl.constexpr):
    pid = tl.program_id(0)
    if pid < LENGTH_PROGRAMS:
        write_lengths(pid, seq_lens_ptr, ext_ptr, len0, len1, len2, len3, off_cu, off_exp, off_dsa, off_dsacu,
                      B, R, N, K, MODE, NUM_DEST, BLOCK_B, CHUNK_R)
    else:
        idx = pid - LENGTH_PROGRAMS
        b = idx // SPLITS
        split = idx % SPLITS
        live = tl.load(seq_lens_ptr + b).to(tl.int32)
        if MODE == MODE_VERIFY:
            live = live + N
        first, count = request_rows(ext_ptr, b, R, N, MODE, BLOCK_B)
        pool = tl.load(req_pool_ptr + b).to(tl.int64)
        src = req_to_token_ptr + tl.multiple_of(pool * stride_pool, SRC_VEC)
        end = tl.minimum(tl.cdiv(live, TILE_W) * TILE_W, W)  # tile-rounded live prefix
        # A pool index outside [0, POOL) (unchecked with check_values=False) reads and writes nothing.
        end = tl.where((pool >= 0) & (pool < POOL), end, 0)
        full = end // BLOCK_COLS  # blocks wholly inside [0, end)
        for block in tl.range(split, tl.cdiv(end, BLOCK_COLS), SPLITS):
            if block < full:
                _copy_block(src, block, end, first, count, pt0, real0, pt1, real1, pt2, real2, pt3, real3,
                            stride_pt, stride_real, HAS_REAL, PAGE_SIZE, NUM_DEST, BLOCK_COLS, REAL_BLOCK,
                            DST_VEC, False)
            else:
                _copy_block(src, block, end, first, count, pt0, real0, pt1, real1, pt2, real2, pt3, real3,
                            stride_pt, stride_real, HAS_REAL, PAGE_SIZE, NUM_DEST, BLOCK_COLS, REAL_BLOCK,
                            DST_VEC, True)


def bounded_metadata(mode: Mode, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, out: MetadataBuffers | Sequence[MetadataBuffers], *,
                     index_topk: int, page_size: int, num_draft_tokens: int = 1,
                     extend_seq_lens: torch.Tensor | None = None, budget: int | None = None,
                     block_cols: int = BLOCK_COLS, num_warps: int = NUM_WARPS,
                     check_values: bool = True) -> None:
    """Write the replay metadata of ``mode`` into ``out`` over each row's live prefix only.

    Same math and arguments as :func:`dsaspec.ops.baseline.dsa_metadata.context_wide_metadata`; ``out`` may
    be several buffer sets of identical layout (the MTP draft step backends), written by one launch
    per four sets. Writes every 1-D output in full, ``page_table_1[row, :min(roundup(live, 128), W))``
    and the real-table columns of those tiles (``live = s``, or ``s + N`` for target verify).
    ``budget`` (None: ``DEFAULT_BUDGET``, 2048) caps the programs per launch:
    ``1 + B * max(1, min(budget // B, 256))``.

    ``check_values`` checks these preconditions on the host (a device sync; the graph replay path
    passes ``False``): pool indices in ``[0, pool)``, ``0 <= s (+N) <= W``, ``extend_seq_lens >= 0``
    and ``sum(extend_seq_lens) == rows``. Unchecked violations never touch memory outside the
    inputs and ``out``: a request whose pool index is out of range is neither read nor written
    (its rows keep their page-table contents), columns stop at ``W``, negative extend lengths
    count as 0, rows past ``sum(extend_seq_lens)`` get length 0, rows past ``rows`` are dropped.

    Tuning knobs (defaults measured on an H200; the written region does not depend on them):
    ``block_cols`` (a power of two >= 128) columns one program moves per step, ``num_warps`` its
    warps. Rows that start 16-byte aligned (``MetadataBuffers.allocate(row_align=4)``, and a
    ``req_to_token`` row stride that is a multiple of 4) get 16-byte vector accesses when
    ``block_cols >= 128 * num_warps``.
    """
    mode = Mode(mode)
    outs = [out] if isinstance(out, MetadataBuffers) else list(out)
    validate_inputs(mode, req_to_token, req_pool_indices, seq_lens, outs, index_topk=index_topk,
                    page_size=page_size, num_draft_tokens=num_draft_tokens,
                    extend_seq_lens=extend_seq_lens, check_values=check_values)
    budget = DEFAULT_BUDGET if budget is None else budget
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if block_cols < TILE or block_cols & (block_cols - 1):
        raise ValueError(f"block_cols must be a power of two >= {TILE}, got {block_cols}")
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps must be a power of two >= 1, got {num_warps}")
    B, R, W = outs[0].batch, outs[0].rows, req_to_token.shape[1]
    splits = num_splits(B, budget)
    block_b, chunk_r, length_programs = launch_shape(B, R)
    has_real = outs[0].real_page_table is not None
    stride_real = outs[0].real_page_table.stride(0) if has_real else 0
    code = mode_code(mode, extend_seq_lens is not None)
    ext = extend_seq_lens if extend_seq_lens is not None else seq_lens
    dst_vec = vector_width(*(o.page_table_1 for o in outs))
    for start in range(0, len(outs), MAX_DESTINATIONS):
        group = outs[start:start + MAX_DESTINATIONS]
        dests = []
        for o in group + [group[0]] * (MAX_DESTINATIONS - len(group)):
            dests += [o.lengths, o.page_table_1, o.real_page_table if has_real else o.page_table_1]
        _bounded_kernel[(length_programs + B * splits,)](
            req_to_token, req_to_token.stride(0), req_pool_indices, seq_lens, ext, *dests,
            *outs[0].length_offsets(), B, R, num_draft_tokens, index_topk, W, req_to_token.shape[0],
            outs[0].page_table_1.stride(0), stride_real, splits, length_programs, MODE=code, HAS_REAL=has_real,
            PAGE_SIZE=page_size, NUM_DEST=len(group), BLOCK_B=block_b, CHUNK_R=chunk_r, TILE_W=TILE,
            BLOCK_COLS=block_cols,
            REAL_BLOCK=triton.next_power_of_2(triton.cdiv(block_cols, page_size)) if has_real else 1,
            SRC_VEC=vector_width(req_to_token), DST_VEC=dst_vec, num_warps=num_warps)
