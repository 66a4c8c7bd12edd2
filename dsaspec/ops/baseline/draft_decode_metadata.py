"""Baseline MTP draft-decode metadata: what engines do today (SGLang's multi-step precompute).

:func:`precompute_and_copy`: the context-wide decode kernel writes a ``[B, W]`` scratch set, then
copies move the whole scratch into the step backends: with three or more backends one
3-destination copy for the first three and one copy per further backend, with fewer one copy per
backend. The replacement is :func:`dsaspec.ops.draft_decode_metadata.draft_decode_metadata`.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from dsaspec.forward_mode import Mode
from dsaspec.ops.baseline.dsa_metadata import context_wide_metadata
from dsaspec.ops.dsa_metadata_common import MetadataBuffers

COPY_BLOCK = 4096  # int32 elements per copy program (16 KiB)
MAX_COPY_DESTINATIONS = 3


@triton.jit
def _copy_kernel(src_len, src_pt, src_real, d0_len, d0_pt, d0_real, d1_len, d1_pt, d1_real,
                 d2_len, d2_pt, d2_real, n_len, n_pt, n_real, pt_programs,
                 HAS_REAL: tl.constexpr, NUM_DEST: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if pid < pt_programs:
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        n = n_pt
        src, dst0, dst1, dst2 = src_pt, d0_pt, d1_pt, d2_pt
    elif pid == pt_programs:
        offs = tl.arange(0, BLOCK).to(tl.int64)
        n = n_len
        src, dst0, dst1, dst2 = src_len, d0_len, d1_len, d2_len
    else:
        offs = (pid - pt_programs - 1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        n = n_real
        src, dst0, dst1, dst2 = src_real, d0_real, d1_real, d2_real
    mask = offs < n
    vals = tl.load(src + offs, mask=mask)
    tl.store(dst0 + offs, vals, mask=mask)
    if NUM_DEST > 1:
        tl.store(dst1 + offs, vals, mask=mask)
    if NUM_DEST > 2:
        tl.store(dst2 + offs, vals, mask=mask)


def copy_metadata(src: MetadataBuffers, dsts: Sequence[MetadataBuffers]) -> None:
    """Copy every buffer of ``src`` in full (all ``W`` columns) into up to three ``dsts`` in one launch."""
    if not 1 <= len(dsts) <= MAX_COPY_DESTINATIONS:
        raise ValueError(f"dsts: 1 to {MAX_COPY_DESTINATIONS} buffer sets per copy, got {len(dsts)}")
    for i, d in enumerate(dsts):
        if not d.same_layout(src):
            raise ValueError(f"dsts[{i}] does not match the layout of src (mode, page size, shapes, device)")
    for b in [src, *dsts]:
        if not b.page_table_1.is_contiguous() or (b.real_page_table is not None and not b.real_page_table.is_contiguous()):
            raise ValueError("copy_metadata copies whole contiguous page tables; got a strided one")
    if src.lengths.numel() > COPY_BLOCK:
        raise ValueError(f"lengths buffer of {src.lengths.numel()} entries exceeds one copy program ({COPY_BLOCK})")
    has_real = src.real_page_table is not None
    n_pt = src.page_table_1.numel()
    n_real = src.real_page_table.numel() if has_real else 0
    pt_programs = triton.cdiv(n_pt, COPY_BLOCK)
    grid = pt_programs + 1 + triton.cdiv(n_real, COPY_BLOCK)
    padded = list(dsts) + [dsts[0]] * (MAX_COPY_DESTINATIONS - len(dsts))
    args = []
    for b in [src] + padded:
        args += [b.lengths, b.page_table_1, b.real_page_table if has_real else b.page_table_1]
    _copy_kernel[(grid,)](*args, src.lengths.numel(), n_pt, n_real, pt_programs,
                          HAS_REAL=has_real, NUM_DEST=len(dsts), BLOCK=COPY_BLOCK)


def precompute_and_copy(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                        seq_lens: torch.Tensor, scratch: MetadataBuffers,
                        outs: Sequence[MetadataBuffers], *, index_topk: int, page_size: int,
                        check_values: bool = True) -> None:
    """Baseline: context-wide DECODE metadata into ``scratch`` (``[B, W]`` + real table), then copy
    it whole into ``outs``: with three or more sets one 3-destination copy, then one copy per
    remaining set; with one or two sets, one copy each.

    ``scratch`` is preallocated by the caller (engines allocate it per replay; a captured graph
    cannot). Writes the 1-D outputs and the tile-rounded live prefix of ``scratch`` (see
    :func:`~dsaspec.ops.baseline.dsa_metadata.context_wide_metadata`), then every buffer of each ``outs[i]``
    over the full width (the scratch's contents past the prefix included).
    ``check_values``: the host-synced precondition checks of
    :func:`~dsaspec.ops.baseline.dsa_metadata.context_wide_metadata` (what happens without them is stated there).
    """
    if not outs:
        raise ValueError("outs: at least one step backend buffer set is required")
    context_wide_metadata(Mode.DECODE, req_to_token, req_pool_indices, seq_lens, scratch,
                          index_topk=index_topk, page_size=page_size, check_values=check_values)
    first = MAX_COPY_DESTINATIONS if len(outs) >= MAX_COPY_DESTINATIONS else 0
    if first:
        copy_metadata(scratch, outs[:first])
    for out in outs[first:]:
        copy_metadata(scratch, [out])
