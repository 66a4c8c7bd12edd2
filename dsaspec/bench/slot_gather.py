"""Sparse MLA's gathers by themselves, two yardsticks: Triton kernels that write one value a
program, so their time is the reads' own (and the dequantization's), not the op's feed, dots or
output.

* :func:`slot_gather` (both caches: 1,152-byte bf16 entries, 656-byte FP8 ``fp8_ds_mla`` ones):
  the gather alone. Program ``(row, block)`` loads the row's ``block``-th ``BLOCK`` slot ids,
  skips the negative ones (the op's empty slots), reads each selected entry whole as int32 words
  in 32-word chunks (128 contiguous bytes a slot and chunk, the entry's last chunk masked) and
  folds them with XOR::

      out[row, block] = XOR over the block's valid slots s and words w of cache_words[s, w]

* :func:`slot_gather_dequant` (``fp8_ds_mla`` only): the same slots' entries read and
  dequantized as the FP8 op must: a 128-code scale group at a time, the e4m3 codes widened to
  fp32 and times the group's fp32 scale; the 64 bf16 rope values widened to fp32. The fold is the
  wrapping int32 sum of those 576 fp32 values' bit patterns::

      out[row, block] = sum mod 2**32 over the block's valid slots s of
                        sum_i bits(fp32(code[s, i]) * scale[s, i // 128]) + sum_j bits(fp32(rope[s, j]))

  Exact in any order, like an XOR, and every loaded byte is in it, so no load can be dropped: a
  changed code or rope value moves it, and so does a changed scale magnitude, which moves all its
  group's product bits the same way (an XOR cancels an even number of last-bit flips; a scale's
  sign alone moves none: 128 times 2**31). A repeated slot counts each time.

:func:`fastest_slot_gather` times either kernel over ``SLOT_GATHER_GRIDS`` (slots a program x
warps) and keeps the fastest, a bound the op's gathers (and dequantization) can at best meet.
:func:`reference_slot_gather` and :func:`reference_slot_gather_dequant` are the same folds in
plain torch.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from dsaspec.ops.checks import check_count, check_tensor
from dsaspec.ops.kv_cache_layout import FP8_GROUP, MLA_FP8_BYTES, MLA_LATENT_DIM, MLA_ROPE_DIM, mla_fp8_views

_CHUNK = 32                                       # int32 words a load a slot: 128 bytes
SLOT_GATHER_GRIDS = tuple(itertools.product((32, 64, 128), (4, 8)))   # (slots a program, warps)


@triton.jit
def _block_entries(cache_ptr, slots_ptr, topk, stride_cache, stride_slots, BLOCK: tl.constexpr):
    """Program ``(row, block)``'s ``BLOCK`` slots: their entries' first elements and which are valid."""
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + tl.program_id(0).to(tl.int64) * stride_slots + idx, mask=idx < topk, other=-1)
    return cache_ptr + slot.to(tl.int64) * stride_cache, slot >= 0


@triton.jit
def _slot_gather_kernel(cache_ptr, slots_ptr, out_ptr, topk, stride_cache, stride_slots, blocks,
                        WORDS: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    base, valid = _block_entries(cache_ptr, slots_ptr, topk, stride_cache, stride_slots, BLOCK)
    cols = tl.arange(0, CHUNK)
    folded = tl.zeros((BLOCK, CHUNK), dtype=tl.int32)
    for start in tl.static_range(0, WORDS, CHUNK):
        word = start + cols
        folded ^= tl.load(base[:, None] + word[None, :], mask=valid[:, None] & (word < WORDS)[None, :], other=0)
    tl.store(out_ptr + tl.program_id(0) * blocks + tl.program_id(1), tl.xor_sum(tl.xor_sum(folded, axis=1), axis=0))


@triton.jit
def _slot_gather_dequant_kernel(cache_ptr, slots_ptr, out_ptr, topk, stride_cache, stride_slots, blocks,
                                LATENT: tl.constexpr, GROUP: tl.constexpr, ROPE: tl.constexpr,
                                BLOCK: tl.constexpr):
    # the entries' first bytes: the host checks the row stride a multiple of 16 bytes, so the JIT's
    # specialization knows them 16-byte aligned and the codes and rope values go by 16-byte loads
    entry, valid = _block_entries(cache_ptr, slots_ptr, topk, stride_cache, stride_slots, BLOCK)
    cols = tl.arange(0, GROUP)
    folded = tl.zeros((BLOCK, GROUP), dtype=tl.int32)
    for group in tl.static_range(LATENT // GROUP):
        scale = tl.load((entry + LATENT + 4 * group).to(tl.pointer_type(tl.float32), bitcast=True),
                        mask=valid, other=0.0)
        code = tl.load(entry[:, None] + (group * GROUP + cols)[None, :], mask=valid[:, None], other=0)
        value = code.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
        folded += value.to(tl.int32, bitcast=True)           # wraps: a sum mod 2**32
    rope_ptr = (entry + LATENT + 4 * (LATENT // GROUP)).to(tl.pointer_type(tl.bfloat16), bitcast=True)
    rope = tl.load(rope_ptr[:, None] + tl.arange(0, ROPE)[None, :], mask=valid[:, None], other=0.0)
    rope_bits = rope.to(tl.float32).to(tl.int32, bitcast=True)
    # [1], not a scalar: the interpreter wraps an array's int32 sum but refuses a scalar out of range
    total = (tl.sum(tl.sum(folded, axis=1), axis=0, keep_dims=True)
             + tl.sum(tl.sum(rope_bits, axis=1), axis=0, keep_dims=True))
    tl.store(out_ptr + tl.program_id(0) * blocks + tl.program_id(1) + tl.arange(0, 1), total)


def _checked_words(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    check_tensor("slots", slots, dtype=(torch.int32,), ndim=2, device=cache.device)
    if cache.dim() != 2 or cache.stride(1) != 1 or (cache.shape[1] * cache.element_size()) % 4:
        raise ValueError(f"cache: expected a [slots, entry] tensor with unit last stride and an entry a whole "
                         f"number of 4-byte words, got {cache.dtype} {tuple(cache.shape)} stride {cache.stride()}")
    return cache.view(torch.int32)


def _checked_fp8_cache(cache: torch.Tensor, slots: torch.Tensor) -> None:
    check_tensor("cache", cache, dtype=torch.uint8, shape=(None, MLA_FP8_BYTES))
    if cache.stride(0) % 16 or cache.data_ptr() % 16:
        raise ValueError(f"cache: an fp8_ds_mla cache's rows must start 16-byte aligned (row stride a multiple of 16 "
                         f"bytes), got row stride {cache.stride(0)} and address {cache.data_ptr():#x}")
    check_tensor("slots", slots, dtype=torch.int32, ndim=2, device=cache.device)


def _check_out(out: torch.Tensor, slots: torch.Tensor, block: int, device) -> int:
    """``block`` (a power of two) and ``out`` (int32 ``[R * ceil(k / block)]``) checked; returns
    the programs a row."""
    check_count("block", block)
    if block & (block - 1):
        raise ValueError(f"block: expected a power of two, got {block}")
    blocks = triton.cdiv(slots.shape[1], block)
    check_tensor("out", out, dtype=torch.int32, shape=(slots.shape[0] * blocks,), device=device)
    return blocks


def slot_gather(cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, block: int = 64,
                num_warps: int = 4) -> torch.Tensor:
    """The gather-only fold of the module docstring: ``cache`` ``[S, entry]`` (any dtype, unit last
    stride, entry bytes a multiple of 4, e.g. bf16 ``[S, 576]`` or uint8 ``[S, 656]``), ``slots``
    int32 ``[R, k]`` (negative: none), ``out`` int32 ``[R * ceil(k / block)]`` written, one value a
    program; returns ``out``. Graph-safe: no allocation, no sync."""
    words = _checked_words(cache, slots)
    rows, topk = slots.shape
    blocks = _check_out(out, slots, block, cache.device)
    if rows and blocks:
        _slot_gather_kernel[(rows, blocks)](words, slots, out, topk, words.stride(0), slots.stride(0), blocks,
                                            WORDS=words.shape[1], BLOCK=block, CHUNK=_CHUNK, num_warps=num_warps)
    return out


def slot_gather_dequant(cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, block: int = 64,
                        num_warps: int = 4) -> torch.Tensor:
    """The gather-and-dequantize fold of the module docstring: ``cache`` an ``fp8_ds_mla`` cache
    (uint8 ``[S, 656]``, unit last stride, rows 16-byte aligned), ``slots`` int32 ``[R, k]``
    (negative: none), ``out`` int32 ``[R * ceil(k / block)]`` written, one fold a program; returns
    ``out``. Graph-safe: no allocation, no sync."""
    _checked_fp8_cache(cache, slots)
    rows, topk = slots.shape
    blocks = _check_out(out, slots, block, cache.device)
    if rows and blocks:
        _slot_gather_dequant_kernel[(rows, blocks)](
            cache, slots, out, topk, cache.stride(0), slots.stride(0), blocks,
            LATENT=MLA_LATENT_DIM, GROUP=FP8_GROUP, ROPE=MLA_ROPE_DIM, BLOCK=block, num_warps=num_warps)
    return out


def _program_slots(slots: torch.Tensor, block: int) -> torch.Tensor:
    """``slots`` ``[R, k]`` padded with -1 to whole blocks: int64 ``[R * ceil(k / block), block]``,
    a row per program of the kernels."""
    rows, topk = slots.shape
    blocks = -(-topk // block)
    padded = torch.full((rows, blocks * block), -1, dtype=torch.int64, device=slots.device)
    padded[:, :topk] = slots
    return padded.view(rows * blocks, block)


def reference_slot_gather(cache: torch.Tensor, slots: torch.Tensor, block: int = 64) -> torch.Tensor:
    """:func:`slot_gather` in plain torch: each program's words gathered (``[R * blocks, block *
    entry words]``, empty slots' zeroed) and XOR-halved down to one column; int32 ``[R * blocks]``."""
    words = cache.contiguous().view(torch.int32)
    picked = _program_slots(slots, block)
    if not picked.numel():
        return torch.empty(0, dtype=torch.int32, device=slots.device)
    gathered = words[picked.clamp(min=0)] * (picked >= 0)[:, :, None]
    flat = gathered.reshape(picked.shape[0], -1)
    while flat.shape[1] > 1:
        if flat.shape[1] % 2:
            flat = torch.cat([flat, torch.zeros_like(flat[:, :1])], dim=1)
        half = flat.shape[1] // 2
        flat = flat[:, :half] ^ flat[:, half:]
    return flat.reshape(-1).to(torch.int32)


def reference_slot_gather_dequant(cache: torch.Tensor, slots: torch.Tensor, block: int = 64) -> torch.Tensor:
    """:func:`slot_gather_dequant` in plain torch, the entries read through
    :func:`~dsaspec.ops.kv_cache_layout.mla_fp8_views` and widened by torch: each slot's 576 fp32
    bit patterns summed in int64, each program's valid slots' sums added, then wrapped to int32
    ``[R * ceil(k / block)]``, the bits :func:`slot_gather_dequant` writes (on NaN-free entries: a
    NaN's payload may differ between the GPU's conversions and torch's)."""
    codes, scales, rope = mla_fp8_views(cache)
    latent = codes.float().unflatten(1, (scales.shape[1], -1)) * scales[:, :, None]
    values = torch.cat([latent.flatten(1), rope.float()], dim=1)                   # fp32 [S, 576]
    per_slot = values.view(torch.int32).sum(dim=1, dtype=torch.int64)
    picked = _program_slots(slots, block)
    sums = torch.where(picked >= 0, per_slot[picked.clamp(min=0)], 0).sum(dim=1)
    return (torch.remainder(sums + 2**31, 2**32) - 2**31).to(torch.int32)


def fastest_slot_gather(cache: torch.Tensor, slots: torch.Tensor, iters: int,
                        gather=slot_gather) -> tuple[float, str]:
    """``(median µs, "slots x warps")`` of the fastest :data:`SLOT_GATHER_GRIDS` entry of
    ``gather`` (:func:`slot_gather` or :func:`slot_gather_dequant`), each timed by
    :func:`~dsaspec.bench.timing.time_in_graph` (cold L2, CUDA graphs)."""
    from dsaspec.bench.timing import time_in_graph

    best = None
    for block, warps in SLOT_GATHER_GRIDS:
        out = torch.empty(slots.shape[0] * triton.cdiv(slots.shape[1], block), dtype=torch.int32, device=cache.device)
        us = time_in_graph(lambda: gather(cache, slots, out, block, warps), iters=iters, graph_diff=False).median_us
        if best is None or us < best[0]:
            best = (us, f"{block} x {warps}w")
    return best
