"""Context-wide DSA replay metadata: the kernels serving engines run at CUDA-graph replay today.

Contract: docs/metadata-kernels.md. The launch has the shape of SGLang's
``fused_dsa_{decode,target_verify,draft_extend}_metadata``: for ``R`` metadata rows of ``B``
requests over a ``[pool, W]`` ``req_to_token`` table, the first ``L = cdiv(R + 1, 128)`` programs
write the 1-D outputs (128 rows each, see ``write_lengths``) and one program per (unit, 128-column
tile) follows, a unit being a metadata row for decode and target verify (``R * cdiv(W, 128)``
programs) and a request for draft extend (``B * cdiv(W, 128)``; the program writes its tile into
every row of the request). A program whose tile starts at or past the live length (``s``, or
``s + N`` for target verify) returns at once, so only ``[0, min(roundup(live, 128), W))`` of a row
is written; the grid still follows the configured width: at W = 1,048,586 every unit costs 8193
programs. This module is the faithful baseline; ``dsa_metadata`` is the live-bounded
replacement; what both share is in ``dsa_metadata_common``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaspec.ops.dsa_metadata_common import (MODE_VERIFY, TILE, MetadataBuffers, launch_shape, mode_code,
                                             request_rows, validate_inputs, write_lengths)
from dsaspec.forward_mode import Mode


# Sizes that differ per batch bucket are not specialised: fewer compiled variants per server.
@triton.jit(do_not_specialize=["B", "R", "W", "POOL", "LENGTH_PROGRAMS"])
def _context_wide_kernel(req_to_token_ptr, stride_pool, req_pool_ptr, seq_lens_ptr, ext_ptr,
                         lengths_ptr, off_cu, off_exp, off_dsa, off_dsacu, pt_ptr, real_ptr,
                         B, R, N, K, W, POOL, stride_pt, stride_real, NUM_TILES, LENGTH_PROGRAMS,
                         MODE: tl.constexpr, HAS_REAL: tl.constexpr, PAGE_SIZE: tl.constexpr,
                         BLOCK_B: tl.constexpr, CHUNK_R: tl.constexpr, TILE_W: tl.constexpr):
    pid = tl.program_id(0)
    if pid < LENGTH_PROGRAMS:
        write_lengths(pid, seq_lens_ptr, ext_ptr, lengths_ptr, lengths_ptr, lengths_ptr, lengths_ptr,
                      off_cu, off_exp, off_dsa, off_dsacu, B, R, N, K, MODE, 1, BLOCK_B, CHUNK_R)
        return
    idx = pid - LENGTH_PROGRAMS
    unit = idx // NUM_TILES
    tile = idx % NUM_TILES
    if MODE == MODE_VERIFY:
        b = unit // N
    else:
        b = unit
    pool = tl.load(req_pool_ptr + b).to(tl.int64)  # issued with the length load, as SGLang's kernels do
    live = tl.load(seq_lens_ptr + b).to(tl.int32)
    if MODE == MODE_VERIFY:
        live = live + N
    if tile * TILE_W >= live:
        return
    if MODE == MODE_VERIFY:
        first = unit
        count = 1
    else:
        first, count = request_rows(ext_ptr, b, R, N, MODE, BLOCK_B)
    cols = tile * TILE_W + tl.arange(0, TILE_W)
    # A pool index outside [0, POOL) (unchecked with check_values=False) reads and writes nothing.
    col_mask = (cols < W) & (pool >= 0) & (pool < POOL)
    vals = tl.load(req_to_token_ptr + pool * stride_pool + cols, mask=col_mask, other=0)
    for j in tl.range(0, count):
        row64 = (first + j).to(tl.int64)
        tl.store(pt_ptr + row64 * stride_pt + cols, vals, mask=col_mask)
        if HAS_REAL:
            tl.store(real_ptr + row64 * stride_real + cols // PAGE_SIZE, vals // PAGE_SIZE,
                     mask=col_mask & (cols % PAGE_SIZE == 0))


def context_wide_metadata(mode: Mode, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                          seq_lens: torch.Tensor, out: MetadataBuffers, *, index_topk: int,
                          page_size: int, num_draft_tokens: int = 1,
                          extend_seq_lens: torch.Tensor | None = None,
                          check_values: bool = True) -> MetadataBuffers:
    """Write the replay metadata of ``mode`` into ``out`` with one program per tile of the full
    table width (baseline).

    Math (docs/metadata-kernels.md): ``cache_seqlens = s (+N for verify)``,
    ``seqlens_expanded[b*N+j] = s+j+1`` (verify) / ``max(s-N+j+1, 0)`` (draft extend),
    ``dsa = min(expanded, index_topk)``, prefix sums, ``page_table_1[row, :W] = T[r[b], :W]``,
    ``real_page_table[row, c] = T[r[b], c*P] // P``.

    Parameters: ``req_to_token`` int32 ``[pool, W]``; ``req_pool_indices`` int32/int64 ``[B]``;
    ``seq_lens`` int32/int64 ``[B]``; ``extend_seq_lens`` int32/int64 ``[B]`` for the variable
    draft-extend form (``None``: N rows per request). Writes every 1-D output in full,
    ``page_table_1[row, :min(roundup(live, 128), W))`` and the real-table columns of those tiles
    (``live = s``, or ``s + N`` for target verify); the rest of each row keeps its contents. One
    launch of ``cdiv(R + 1, 128) + U * cdiv(W, 128)`` programs, ``U = R`` (decode, target verify)
    or ``B`` (draft extend).

    ``check_values`` checks these preconditions on the host (a device sync; the graph replay path
    passes ``False``): pool indices in ``[0, pool)``, ``0 <= s (+N) <= W``, ``extend_seq_lens >= 0``
    and ``sum(extend_seq_lens) == rows``. Unchecked violations never touch memory outside the
    inputs and ``out``: a request whose pool index is out of range is neither read nor written,
    negative extend lengths count as 0, rows past ``sum(extend_seq_lens)`` get length 0 and an
    untouched page-table row, rows past ``rows`` are dropped.
    """
    mode = Mode(mode)
    validate_inputs(mode, req_to_token, req_pool_indices, seq_lens, [out], index_topk=index_topk,
                    page_size=page_size, num_draft_tokens=num_draft_tokens,
                    extend_seq_lens=extend_seq_lens, check_values=check_values)
    B, R, W = out.batch, out.rows, req_to_token.shape[1]
    code = mode_code(mode, extend_seq_lens is not None)
    block_b, chunk_r, length_programs = launch_shape(B, R)
    num_tiles = triton.cdiv(W, TILE)
    real = out.real_page_table
    units = R if mode is Mode.TARGET_VERIFY else B
    _context_wide_kernel[(length_programs + units * num_tiles,)](
        req_to_token, req_to_token.stride(0), req_pool_indices, seq_lens,
        extend_seq_lens if extend_seq_lens is not None else seq_lens,
        out.lengths, *out.length_offsets(), out.page_table_1, real if real is not None else out.page_table_1,
        B, R, num_draft_tokens, index_topk, W, req_to_token.shape[0], out.page_table_1.stride(0),
        real.stride(0) if real is not None else 0, num_tiles, length_programs, MODE=code, HAS_REAL=real is not None,
        PAGE_SIZE=page_size, BLOCK_B=block_b, CHUNK_R=chunk_r, TILE_W=TILE)
    return out
