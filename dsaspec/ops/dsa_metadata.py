"""Context-wide DSA replay metadata: the kernels serving engines run at CUDA-graph replay today.

Contract: docs/metadata-kernels.md. For ``R`` metadata rows over a ``[pool, W]`` ``req_to_token``
table, the first ``L = cdiv(R + 1, 128)`` programs write the 1-D outputs (128 rows each, see
``write_lengths``) and program ``L + row * cdiv(W, 128) + tile`` copies one 128-column tile of the row's ``req_to_token`` row into ``page_table_1`` (and ``// P`` of its page
starts into ``real_page_table``). Nothing looks at the live length, so the cost follows the
configured context: at W = 1,048,586 every row costs 8193 programs. This module is the faithful
baseline; ``dsa_metadata_bounded`` is the live-bounded replacement; what both share is in
``dsa_metadata_common``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaspec.ops.dsa_metadata_common import (MODE_DECODE, MODE_EXTEND_VARIABLE, TILE, MetadataBuffers,
                                             Mode, extend_prefix, launch_shape, mode_code, validate_inputs,
                                             write_lengths)


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
    else:
        idx = pid - LENGTH_PROGRAMS
        row = idx // NUM_TILES
        tile = idx % NUM_TILES
        if MODE == MODE_DECODE:
            b = row
        elif MODE == MODE_EXTEND_VARIABLE:
            _, _, ends = extend_prefix(ext_ptr, B, BLOCK_B)
            b = tl.sum((ends <= row).to(tl.int32), axis=0)
        else:
            b = row // N
        pool = tl.load(req_pool_ptr + b, mask=b < B, other=0).to(tl.int64)
        cols = tile * TILE_W + tl.arange(0, TILE_W)
        # A pool index outside [0, POOL) (unchecked with check_values=False) reads and writes nothing.
        col_mask = (cols < W) & (b < B) & (pool >= 0) & (pool < POOL)
        vals = tl.load(req_to_token_ptr + pool * stride_pool + cols, mask=col_mask, other=0)
        row64 = row.to(tl.int64)
        tl.store(pt_ptr + row64 * stride_pt + cols, vals, mask=col_mask)
        if HAS_REAL:
            tl.store(real_ptr + row64 * stride_real + cols // PAGE_SIZE, vals // PAGE_SIZE,
                     mask=col_mask & (cols % PAGE_SIZE == 0))


def context_wide_metadata(mode: Mode, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                          seq_lens: torch.Tensor, out: MetadataBuffers, *, index_topk: int,
                          page_size: int, num_draft_tokens: int = 1,
                          extend_seq_lens: torch.Tensor | None = None,
                          check_values: bool = True) -> MetadataBuffers:
    """Write the replay metadata of ``mode`` into ``out`` over the full table width (baseline).

    Math (docs/metadata-kernels.md): ``cache_seqlens = s (+N for verify)``,
    ``seqlens_expanded[b*N+j] = s+j+1`` (verify) / ``max(s-N+j+1, 0)`` (draft extend),
    ``dsa = min(expanded, index_topk)``, prefix sums, ``page_table_1[row, :W] = T[r[b], :W]``,
    ``real_page_table[row, c] = T[r[b], c*P] // P``.

    Parameters: ``req_to_token`` int32 ``[pool, W]``; ``req_pool_indices`` int32/int64 ``[B]``;
    ``seq_lens`` int32/int64 ``[B]``; ``extend_seq_lens`` int32/int64 ``[B]`` for the variable
    draft-extend form (``None``: N rows per request). Writes every buffer of ``out``; one launch
    of ``cdiv(R + 1, 128) + R * cdiv(W, 128)`` programs.

    ``check_values`` checks these preconditions on the host (a device sync; the graph replay path
    passes ``False``): pool indices in ``[0, pool)``, ``0 <= s (+N) <= W``, ``extend_seq_lens >= 0``
    and ``sum(extend_seq_lens) == rows``. Unchecked violations never touch memory outside the
    inputs and ``out``: a row whose pool index is out of range is neither read nor written,
    negative extend lengths count as 0, rows past ``sum(extend_seq_lens)`` get length 0 and an
    untouched page-table row, requests past ``rows`` are dropped.
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
    _context_wide_kernel[(length_programs + R * num_tiles,)](
        req_to_token, req_to_token.stride(0), req_pool_indices, seq_lens,
        extend_seq_lens if extend_seq_lens is not None else seq_lens,
        out.lengths, *out.length_offsets(), out.page_table_1, real if real is not None else out.page_table_1,
        B, R, num_draft_tokens, index_topk, W, req_to_token.shape[0], out.page_table_1.stride(0),
        real.stride(0) if real is not None else 0, num_tiles, length_programs, MODE=code, HAS_REAL=real is not None,
        PAGE_SIZE=page_size, BLOCK_B=block_b, CHUNK_R=chunk_r, TILE_W=TILE)
    return out
