"""What sparse MLA's gathers cost by themselves: a Triton kernel that reads, for every row, the
whole cache entry of each of its selected slots (1,152 bytes on the bf16 cache, 656 on the FP8
``fp8_ds_mla`` one), and nothing else.

Program ``(row, block)`` loads the row's ``block``-th ``BLOCK`` slot ids, skips the negative ones
(the op's empty slots), reads each selected entry as int32 words in 32-word chunks (128
contiguous bytes a slot and chunk, the entry's last chunk masked) and folds them with XOR:

    out[row, block] = XOR over the block's valid slots s and words w of cache_words[s, w]

One int32 is written a program, so the time is the gathers' own: the op's reads without its
math, its feed or its output. :func:`fastest_slot_gather` times the kernel over
``SLOT_GATHER_GRIDS`` (slots a program x warps) and keeps the fastest, a bound the op's gather
partition can at best meet. :func:`reference_slot_gather` is the same fold in plain torch.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from dsaspec.ops.checks import check_tensor

_CHUNK = 32                                       # int32 words a load a slot: 128 bytes
SLOT_GATHER_GRIDS = tuple(itertools.product((32, 64, 128), (4, 8)))   # (slots a program, warps)


@triton.jit
def _slot_gather_kernel(cache_ptr, slots_ptr, out_ptr, topk, stride_cache, stride_slots, blocks,
                        WORDS: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    block = tl.program_id(1)
    idx = block * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + row.to(tl.int64) * stride_slots + idx, mask=idx < topk, other=-1)
    valid = slot >= 0
    base = cache_ptr + slot.to(tl.int64) * stride_cache
    cols = tl.arange(0, CHUNK)
    folded = tl.zeros((BLOCK, CHUNK), dtype=tl.int32)
    for start in tl.static_range(0, WORDS, CHUNK):
        word = start + cols
        folded ^= tl.load(base[:, None] + word[None, :], mask=valid[:, None] & (word < WORDS)[None, :], other=0)
    tl.store(out_ptr + row * blocks + block, tl.xor_sum(tl.xor_sum(folded, axis=1), axis=0))


def _checked_words(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    check_tensor("slots", slots, dtype=(torch.int32,), ndim=2, device=cache.device)
    if cache.dim() != 2 or cache.stride(1) != 1 or (cache.shape[1] * cache.element_size()) % 4:
        raise ValueError(f"cache: expected a [slots, entry] tensor with unit last stride and an entry a whole "
                         f"number of 4-byte words, got {cache.dtype} {tuple(cache.shape)} stride {cache.stride()}")
    return cache.view(torch.int32)


def slot_gather(cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, block: int = 64,
                num_warps: int = 4) -> torch.Tensor:
    """The fold of the module docstring: ``cache`` ``[S, entry]`` (any dtype, unit last stride,
    entry bytes a multiple of 4, e.g. bf16 ``[S, 576]`` or uint8 ``[S, 656]``), ``slots`` int32
    ``[R, k]`` (negative: none), ``out`` int32 ``[R * ceil(k / block)]`` written, one value a
    program; returns ``out``. Graph-safe: no allocation, no sync."""
    words = _checked_words(cache, slots)
    rows, topk = slots.shape
    blocks = triton.cdiv(topk, block)
    check_tensor("out", out, dtype=(torch.int32,), shape=(rows * blocks,), device=cache.device)
    if rows and blocks:
        _slot_gather_kernel[(rows, blocks)](words, slots, out, topk, words.stride(0), slots.stride(0), blocks,
                                            WORDS=words.shape[1], BLOCK=block, CHUNK=_CHUNK, num_warps=num_warps)
    return out


def reference_slot_gather(cache: torch.Tensor, slots: torch.Tensor, block: int = 64) -> torch.Tensor:
    """:func:`slot_gather` in plain torch: each program's words gathered (``[R * blocks, block *
    entry words]``, empty slots' zeroed) and XOR-halved down to one column; int32 ``[R * blocks]``."""
    words = cache.contiguous().view(torch.int32)
    rows, topk = slots.shape
    blocks = -(-topk // block)
    if not rows or not blocks:
        return torch.empty(0, dtype=torch.int32, device=slots.device)
    padded = torch.full((rows, blocks * block), -1, dtype=torch.int64, device=slots.device)
    padded[:, :topk] = slots
    picked = padded.view(rows * blocks, block)
    gathered = words[picked.clamp(min=0)] * (picked >= 0)[:, :, None]
    flat = gathered.reshape(rows * blocks, -1)
    while flat.shape[1] > 1:
        if flat.shape[1] % 2:
            flat = torch.cat([flat, torch.zeros_like(flat[:, :1])], dim=1)
        half = flat.shape[1] // 2
        flat = flat[:, :half] ^ flat[:, half:]
    return flat.reshape(-1).to(torch.int32)


def fastest_slot_gather(cache: torch.Tensor, slots: torch.Tensor, iters: int) -> tuple[float, str]:
    """``(median µs, "slots x warps")`` of the fastest :data:`SLOT_GATHER_GRIDS` entry, each timed
    by :func:`~dsaspec.bench.timing.time_in_graph` (cold L2, CUDA graphs)."""
    from dsaspec.bench.timing import time_in_graph

    best = None
    for block, warps in SLOT_GATHER_GRIDS:
        out = torch.empty(slots.shape[0] * triton.cdiv(slots.shape[1], block), dtype=torch.int32,
                          device=cache.device)
        us = time_in_graph(lambda: slot_gather(cache, slots, out, block, warps), iters=iters,
                           graph_diff=False).median_us
        if best is None or us < best[0]:
            best = (us, f"{block} x {warps}w")
    return best
