"""The DSA ops of the runtime in plain torch, for eager runs without the Triton kernels (fp32
models on the CPU, and the tests' tight comparisons).

Same signatures and contracts as the Triton ops in ``dsaspec.ops`` (``out=`` buffers,
``check_values``), computed batched over the rows with masks. They read the longest live length
on the host, so they cannot be captured in a CUDA graph. The schedule of the Triton indexer has
no meaning here: :func:`indexer_schedule` leaves its buffer as it is.

FP8 caches (uint8, the layouts of :mod:`dsaspec.memory`): :func:`store_mla` and
:func:`store_index_k` quantize the written rows (ue8m0 scales per 128 values, the rule of
:mod:`dsaspec.ops.fp8_kv`), and the reads gather the selected slots, dequantize them to fp32 and
run the same math.
"""

from __future__ import annotations

import torch

from dsaspec.memory import PAGE_SIZE
from dsaspec.ops.kv_cache_layout import index_k_fp8_views, is_fp8_cache, mla_fp8_views
from dsaspec.ops.fp8_gemm import BLOCK, quantize_blocks
from dsaspec.ops.order_key import fp32_order_key

LATENT_DIM = 512


def store_mla(cache, loc, rows, check_values=True):
    """Write ``rows [R, 576]`` at slots ``loc``: a copy into a bf16 cache, quantized (latent
    e4m3 + ue8m0 scale per 128, rope key bf16) into an ``fp8_ds_mla`` cache."""
    if not is_fp8_cache(cache):
        cache.index_copy_(0, loc, rows.to(cache.dtype))
        return
    latent, scale, rope = mla_fp8_views(cache)
    codes, scales = quantize_blocks(rows[:, :LATENT_DIM], 1, "ue8m0")
    latent[loc] = codes
    scale[loc] = scales
    rope[loc] = rows[:, LATENT_DIM:].to(torch.bfloat16)


def store_index_k(cache, loc, keys, check_values=True):
    """Write indexer ``keys [R, 128]`` at slots ``loc``: a copy into a bf16 cache, e4m3 + one
    ue8m0 scale a token into an FP8 paged cache."""
    if not is_fp8_cache(cache):
        cache.index_copy_(0, loc, keys.to(cache.dtype))
        return
    codes, scale = index_k_fp8_views(cache)
    q, s = quantize_blocks(keys, 1, "ue8m0")
    page, offset = loc // PAGE_SIZE, loc % PAGE_SIZE
    codes[page, offset] = q
    scale[page, offset] = s[:, 0]


def _mla_entries(kv_cache, slots):
    """fp32 entries ``[*slots.shape, 576]`` of (non-negative) ``slots``, dequantized from an FP8 cache."""
    if not is_fp8_cache(kv_cache):
        return kv_cache.float()[slots]
    latent, scale, rope = mla_fp8_views(kv_cache)
    values = latent[slots].float() * scale[slots].repeat_interleave(BLOCK, dim=-1)
    return torch.cat((values, rope[slots].float()), dim=-1)


def _index_keys(k_cache, slots):
    """fp32 indexer keys ``[*slots.shape, 128]`` of (non-negative) ``slots``."""
    if not is_fp8_cache(k_cache):
        return k_cache.float()[slots]
    codes, scale = index_k_fp8_views(k_cache)
    page, offset = slots // PAGE_SIZE, slots % PAGE_SIZE
    return codes[page, offset].float() * scale[page, offset][..., None]


def _live_width(seqlens: torch.Tensor, *widths: int) -> int:
    """Longest row (host sync), checked against every width it must fit in."""
    longest = int(seqlens.max()) if seqlens.numel() else 0
    for width in widths:
        if longest > width:
            raise ValueError(f"seqlens: the longest row ({longest} live tokens) does not fit in width {width}")
    return max(longest, 0)


def indexer_schedule(seqlens: torch.Tensor, num_sms: int, out: torch.Tensor, **_) -> torch.Tensor:
    """No schedule is needed by :func:`indexer_logits`: returns ``out`` untouched."""
    return out


def indexer_logits(q, weights, k_cache, page_table_1, seqlens, schedule, out, check_values=True,
                   **_):
    """``out[r, t] = sum_h weights[r, h] * relu(q[r, h] . k_cache[page_table_1[r, t]])`` for
    ``t < seqlens[r]``, ``-inf`` for the other columns up to the longest row; fp32 math, every
    row. With an FP8 cache each (row, head) query is quantized first (e4m3, one ue8m0 scale,
    folded into its weight), as the Triton op does. ``schedule`` and the Triton op's row
    skipping and grouping arguments are ignored."""
    live = _live_width(seqlens, page_table_1.shape[1], out.shape[1])
    positions = torch.arange(live, device=q.device)
    in_row = positions[None, :] < seqlens[:, None]
    slots = torch.where(in_row, page_table_1[:, :live], 0).long()
    keys = _index_keys(k_cache, slots)                                   # [R, live, d]
    if is_fp8_cache(k_cache):
        rows, heads, dim = q.shape
        codes, scales = quantize_blocks(q.reshape(rows * heads, dim), 1, "ue8m0")
        q = codes.view(rows, heads, dim)
        weights = weights * scales.view(rows, heads)
    scores = torch.einsum("rhd,rtd->rht", q.float(), keys).clamp_min(0)
    logits = torch.einsum("rh,rht->rt", weights.float(), scores)
    out[:, :live] = torch.where(in_row, logits, float("-inf"))
    return out


def topk_slots(logits, seqlens, page_table_1, k, out, check_values=True, **_):
    """Per row the slots of the ``min(seqlens[r], k)`` largest live logits (ties to the lowest
    position), in ascending position order, then ``-1``. Rows with ``seqlens[r] <= k`` take every
    live position. The Triton op's ``workspace`` and ``baseline_read_short_rows`` are ignored."""
    live = _live_width(seqlens, logits.shape[1], page_table_1.shape[1])
    positions = torch.arange(live, device=logits.device)
    in_row = positions[None, :] < seqlens[:, None]
    keys = torch.where(in_row, fp32_order_key(logits[:, :live]), -1)
    order = torch.sort(keys, dim=1, descending=True, stable=True)
    taken = min(k, live)
    chosen = order.indices[:, :taken]
    valid = order.values[:, :taken] >= 0
    chosen = torch.sort(torch.where(valid, chosen, live), dim=1).values   # invalid last
    valid = chosen < live
    slots = torch.gather(page_table_1[:, :max(live, 1)], 1, chosen.clamp(max=max(live - 1, 0)))
    out.fill_(-1)
    out[:, :taken] = torch.where(valid, slots, -1)
    return out


def sparse_mla_decode(q, kv_cache, slots, sm_scale, out, check_values=True, **_):
    """``out[r, h] = softmax_j(sm_scale * q[r, h] . kv[s_j]) @ kv[s_j, :512]`` over the valid
    (``>= 0``) slots of row ``r``; zeros for a row without one. fp32 math."""
    valid = slots >= 0
    keys = _mla_entries(kv_cache, slots.clamp_min(0).long())             # [R, k, 576]
    scores = torch.einsum("rhd,rkd->rhk", q.float(), keys) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)                 # all-masked rows -> 0
    out.copy_(torch.einsum("rhk,rkd->rhd", probs, keys[..., :LATENT_DIM]))
    return out
