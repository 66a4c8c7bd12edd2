"""Quantize-on-write into the FP8 KV caches and the dequantizing gather out of them (Triton).

The byte layouts are those of :mod:`dsaspec.memory` (``fp8_ds_mla``, 656 B a slot; the paged
indexer key cache, 132 B a token in 64-token pages). A written row is quantized per 128 values
with a ue8m0 scale, the rule of :mod:`dsaspec.ops.e4m3`:

    amax = max(max |x[128 g : 128 g + 128]|, 1e-4)
    s_g  = 2 ** ceil(log2(amax / 448))     (amax / 448 correctly rounded in fp32, then the
                                            exponent of its bits, plus one unless the mantissa is 0)
    q    = e4m3_rne(clamp(x / s_g, -448, 448)), a zero code +0

so an all-zero group gets ``s = 2**-22`` and zero codes, and a group holding a NaN or an infinity
gets ``s = NaN`` and zero codes: it reads back as NaN, never as finite garbage. The MLA rope key
(64 values) is stored as bf16 (rounded to nearest even), not quantized. Reads return ``code * s`` (exact in fp32) and the
rope key widened; a negative slot reads as zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaspec.ops.kv_cache_layout import (PAGE_SIZE, FP8_GROUP, INDEX_HEAD_DIM, MLA_LATENT_DIM, MLA_ROPE_DIM,
                                         index_k_fp8_views, is_fp8_cache, mla_fp8_views)
from dsaspec.ops.checks import check_tensor
from dsaspec.ops.e4m3 import quantize_rows

_FLOAT_DTYPES = (torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_INDEX_ROWS = 16          # indexer keys per program
_MLA_GROUPS = MLA_LATENT_DIM // FP8_GROUP


@triton.jit
def _bf16_bits(x):
    """The bits (int16) of fp32 ``x`` rounded to bf16, to nearest even, a NaN as 0x7FC0 (as
    torch rounds): done on the bits, because the interpreter's fp32 -> bf16 cast truncates."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, rounded).to(tl.int16)


@triton.jit
def _store_mla_kernel(x_ptr, loc_ptr, latent_ptr, scale_ptr, rope_ptr, stride_x, stride_latent,
                      stride_scale, stride_rope, GROUPS: tl.constexpr, GROUP: tl.constexpr,
                      ROPE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + row).to(tl.int64)
    g = tl.arange(0, GROUPS)
    c = tl.arange(0, GROUP)
    x = tl.load(x_ptr + row * stride_x + g[:, None] * GROUP + c[None, :]).to(tl.float32)
    q, s = quantize_rows(x, True)
    tl.store(latent_ptr + slot * stride_latent + g[:, None] * GROUP + c[None, :], q.to(latent_ptr.dtype.element_ty))
    tl.store(scale_ptr + slot * stride_scale + g, s)
    r = tl.arange(0, ROPE)
    rope = tl.load(x_ptr + row * stride_x + GROUPS * GROUP + r).to(tl.float32)
    tl.store(rope_ptr + slot * stride_rope + r, _bf16_bits(rope))


@triton.jit(do_not_specialize=["R"])
def _store_index_k_kernel(x_ptr, loc_ptr, key_ptr, scale_ptr, R, stride_x, stride_key_page,
                          stride_scale_page, ROWS: tl.constexpr, DIM: tl.constexpr, PAGE: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < R
    c = tl.arange(0, DIM)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + c[None, :], mask=live[:, None], other=0.0)
    q, s = quantize_rows(x.to(tl.float32), True)
    slot = tl.load(loc_ptr + rows, mask=live, other=0).to(tl.int64)
    page, offset = slot // PAGE, slot % PAGE
    tl.store(key_ptr + (page * stride_key_page + offset * DIM)[:, None] + c[None, :],
             q.to(key_ptr.dtype.element_ty), mask=live[:, None])
    tl.store(scale_ptr + page * stride_scale_page + offset, s, mask=live)


@triton.jit
def _gather_mla_kernel(slots_ptr, latent_ptr, scale_ptr, rope_ptr, out_ptr, stride_latent,
                       stride_scale, stride_rope, stride_out, GROUPS: tl.constexpr,
                       GROUP: tl.constexpr, ROPE: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    valid = slot >= 0
    slot = tl.maximum(slot, 0)
    g = tl.arange(0, GROUPS)
    c = tl.arange(0, GROUP)
    codes = tl.load(latent_ptr + slot * stride_latent + g[:, None] * GROUP + c[None, :]).to(tl.float32)
    s = tl.load(scale_ptr + slot * stride_scale + g)
    latent = tl.where(valid, codes * s[:, None], 0.0)
    tl.store(out_ptr + i * stride_out + g[:, None] * GROUP + c[None, :], latent.to(out_ptr.dtype.element_ty))
    r = tl.arange(0, ROPE)
    rope = tl.where(valid, tl.load(rope_ptr + slot * stride_rope + r).to(tl.float32), 0.0)
    tl.store(out_ptr + i * stride_out + GROUPS * GROUP + r, rope.to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["N"])
def _gather_index_k_kernel(slots_ptr, key_ptr, scale_ptr, out_ptr, N, stride_key_page,
                           stride_scale_page, stride_out, ROWS: tl.constexpr, DIM: tl.constexpr,
                           PAGE: tl.constexpr):
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = i < N
    slot = tl.load(slots_ptr + i, mask=live, other=-1).to(tl.int64)
    valid = slot >= 0
    slot = tl.maximum(slot, 0)
    page, offset = slot // PAGE, slot % PAGE
    c = tl.arange(0, DIM)
    codes = tl.load(key_ptr + (page * stride_key_page + offset * DIM)[:, None] + c[None, :],
                    mask=live[:, None], other=0.0).to(tl.float32)
    s = tl.load(scale_ptr + page * stride_scale_page + offset, mask=live, other=0.0)
    keys = tl.where(valid[:, None], codes * s[:, None], 0.0)
    tl.store(out_ptr + i[:, None].to(tl.int64) * stride_out + c[None, :], keys.to(out_ptr.dtype.element_ty),
             mask=live[:, None])


def _check_rows(name: str, x, width: int) -> None:
    check_tensor(name, x, dtype=_FLOAT_DTYPES, shape=(None, width))


def _check_slots(name: str, slots, device, num_slots: int, lowest: int, check_values: bool,
                 ndim: int | None = 1) -> None:
    check_tensor(name, slots, dtype=_INDEX_DTYPES, ndim=ndim, device=device, contiguous_last=False)
    if check_values and slots.numel() and (int(slots.min()) < lowest or int(slots.max()) >= num_slots):
        raise ValueError(f"{name}: slots must lie in [{lowest}, {num_slots}), got "
                         f"[{int(slots.min())}, {int(slots.max())}]")


def store_mla(cache: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor, check_values: bool = True) -> None:
    """Write ``rows`` ``[R, 576]`` (normed latent | roped key) at slots ``loc`` ``[R]`` of a layer's
    MLA cache: ``index_copy_`` into a bf16 cache, quantized (module docstring) into an
    ``fp8_ds_mla`` cache (uint8 ``[slots, 656]``). ``check_values``: ``loc`` in range (host sync)."""
    if not is_fp8_cache(cache):
        cache.index_copy_(0, loc, rows.to(cache.dtype))
        return
    latent, scale, rope = mla_fp8_views(cache)
    _check_rows("rows", rows, MLA_LATENT_DIM + MLA_ROPE_DIM)
    _check_slots("loc", loc, cache.device, cache.shape[0], 0, check_values)
    if loc.shape[0] != rows.shape[0]:
        raise ValueError(f"loc: expected {rows.shape[0]} slots (one per row), got {loc.shape[0]}")
    if rows.shape[0]:
        _store_mla_kernel[(rows.shape[0],)](rows, loc, latent, scale, rope.view(torch.int16), rows.stride(0), latent.stride(0),
                                            scale.stride(0), rope.stride(0), GROUPS=_MLA_GROUPS,
                                            GROUP=FP8_GROUP, ROPE=MLA_ROPE_DIM)


def store_index_k(cache: torch.Tensor, loc: torch.Tensor, keys: torch.Tensor, check_values: bool = True) -> None:
    """Write indexer ``keys`` ``[R, 128]`` at slots ``loc`` ``[R]``: ``index_copy_`` into a bf16
    cache, quantized with one ue8m0 scale a token into an FP8 paged cache (uint8 ``[pages, 8448]``)."""
    if not is_fp8_cache(cache):
        cache.index_copy_(0, loc, keys.to(cache.dtype))
        return
    codes, scale = index_k_fp8_views(cache)
    _check_rows("keys", keys, INDEX_HEAD_DIM)
    _check_slots("loc", loc, cache.device, cache.shape[0] * PAGE_SIZE, 0, check_values)
    if loc.shape[0] != keys.shape[0]:
        raise ValueError(f"loc: expected {keys.shape[0]} slots (one per key), got {loc.shape[0]}")
    r = keys.shape[0]
    if r:
        _store_index_k_kernel[(triton.cdiv(r, _INDEX_ROWS),)](
            keys, loc, codes, scale, r, keys.stride(0), codes.stride(0), scale.stride(0),
            ROWS=_INDEX_ROWS, DIM=INDEX_HEAD_DIM, PAGE=PAGE_SIZE)


def _gather_out(slots, width, out_dtype, device):
    if out_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"out_dtype: expected one of {_FLOAT_DTYPES}, got {out_dtype}")
    return torch.empty(*slots.shape, width, dtype=out_dtype, device=device)


def gather_mla(cache: torch.Tensor, slots: torch.Tensor, out_dtype: torch.dtype = torch.float32,
               check_values: bool = True) -> torch.Tensor:
    """Dequantized entries of ``slots`` (int, any shape; ``-1``: none) of an ``fp8_ds_mla`` cache:
    ``[*slots.shape, 576]`` (``out_dtype``) = latent codes * their scale | rope key; zeros for a
    negative slot. ``check_values``: slots in ``[-1, num_slots)`` (host sync)."""
    latent, scale, rope = mla_fp8_views(cache)
    _check_slots("slots", slots, cache.device, cache.shape[0], -1, check_values, ndim=None)
    out = _gather_out(slots, MLA_LATENT_DIM + MLA_ROPE_DIM, out_dtype, cache.device)
    flat, flat_out = slots.reshape(-1).contiguous(), out.view(-1, out.shape[-1])
    if flat.numel():
        _gather_mla_kernel[(flat.numel(),)](flat, latent, scale, rope, flat_out, latent.stride(0),
                                            scale.stride(0), rope.stride(0), flat_out.stride(0),
                                            GROUPS=_MLA_GROUPS, GROUP=FP8_GROUP, ROPE=MLA_ROPE_DIM)
    return out


def gather_index_k(cache: torch.Tensor, slots: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                   check_values: bool = True) -> torch.Tensor:
    """Dequantized indexer keys of ``slots`` (int, any shape; ``-1``: none) of an FP8 paged cache:
    ``[*slots.shape, 128]`` (``out_dtype``) = codes * the token's scale; zeros for a negative slot."""
    codes, scale = index_k_fp8_views(cache)
    _check_slots("slots", slots, cache.device, cache.shape[0] * PAGE_SIZE, -1, check_values, ndim=None)
    out = _gather_out(slots, INDEX_HEAD_DIM, out_dtype, cache.device)
    flat, flat_out = slots.reshape(-1).contiguous(), out.view(-1, INDEX_HEAD_DIM)
    n = flat.numel()
    if n:
        _gather_index_k_kernel[(triton.cdiv(n, _INDEX_ROWS),)](
            flat, codes, scale, flat_out, n, codes.stride(0), scale.stride(0), flat_out.stride(0),
            ROWS=_INDEX_ROWS, DIM=INDEX_HEAD_DIM, PAGE=PAGE_SIZE)
    return out
