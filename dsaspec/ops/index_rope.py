"""The lightning indexer's query and key epilogues in one kernel each (Triton): RoPE on the first
``rope_dim`` values of every 128-wide row, the key's LayerNorm before it, the 128-wide Hadamard
rotation after it (FP8 key caches), and the key's cache write.

Per row ``x`` (model dtype; ``round`` rounds fp32 to the model dtype, to nearest even):

    key:    y = round(LayerNorm(x) * w + b)    (fp32 statistics, biased variance)
    both:   y = round(RoPE(y))                 (pairs (2i, 2i+1) when interleaved, else (i, i + rope/2);
                                                fp32 x*cos - x'*sin, x*sin + x'*cos, no FMA)
    rotate: y = round(s * 128**-0.5)           (s = y @ H with H the Sylvester +-1 Hadamard matrix:
                                                the fast Walsh-Hadamard transform, 7 stages of fp32
                                                adds/subtracts, then one fp32 multiply)

The key is then written at its slot: a copy into a dense cache ``[slots, 128]`` (model dtype), or
quantized (e4m3, one ue8m0 scale a token, the rule of :mod:`dsaspec.ops.e4m3`) into the FP8 paged
cache. RoPE alone is bit-identical to the torch ops; the LayerNorm's sums and the rotation's
sums run in their own order (the torch ops rotate by an fp32 matmul with ``H * 128**-0.5``), so
a LayerNorm'd or rotated value may differ from them by one ulp of the model dtype. A program owns
16 whole rows, so a row's bits never depend on the other rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaspec.ops.checks import check_tensor
from dsaspec.ops.e4m3 import quantize_rows
from dsaspec.ops.kv_cache_layout import INDEX_HEAD_DIM, PAGE_SIZE, index_k_fp8_views, is_fp8_cache

_ROWS = 16                # rows per program
_FLOAT_DTYPES = (torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_OUT, _DENSE, _FP8 = 0, 1, 2   # where a row goes: an output tensor, a dense cache, the FP8 cache


@triton.jit
def _round(x, BF16: tl.constexpr):
    """fp32 ``x`` rounded to bf16 (nearest even, NaN kept) and widened back, when ``BF16``; on the
    bits, as the interpreter's fp32 -> bf16 cast truncates."""
    if BF16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        x = tl.where(x != x, x, rounded)
    return x


@triton.jit
def rope_pairs(c, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr):
    """For rope columns ``c``: the column each is rotated with, the index of its angle, and whether
    its sin term is negated (the first of its pair): ``(c ^ 1, c // 2, c even)`` interleaved, else
    ``(c +- ROPE / 2, c % (ROPE / 2), c < ROPE / 2)``."""
    if INTERLEAVED:
        partner, pair, first = c ^ 1, c // 2, (c % 2) == 0
    else:
        half: tl.constexpr = ROPE // 2
        first = c < half
        partner, pair = tl.where(first, c + half, c - half), c % half
    return partner, pair, first


@triton.jit
def _load_normed(x_ptr, rows, cols, live, stride_x, mean, rstd, w_ptr, b_ptr, NORM: tl.constexpr,
                 BF16: tl.constexpr):
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=live[:, None],
                other=0.0).to(tl.float32)
    if NORM:
        w = tl.load(w_ptr + cols).to(tl.float32)
        b = tl.load(b_ptr + cols).to(tl.float32)
        x = _round((x - mean[:, None]) * rstd[:, None] * w[None, :] + b[None, :], BF16)
    return x


@triton.jit(do_not_specialize=["N", "heads"])
def _index_rope_kernel(x_ptr, cos_ptr, sin_ptr, w_ptr, b_ptr, out_ptr, loc_ptr, scale_ptr, N, heads,
                       eps, stride_x, stride_cos, stride_out, stride_scale, ROWS: tl.constexpr,
                       DIM: tl.constexpr, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr,
                       NORM: tl.constexpr, ROTATE: tl.constexpr, DEST: tl.constexpr, BF16: tl.constexpr,
                       PAGE: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < N
    c = tl.arange(0, DIM)
    # past the rope dims c is its own partner with cos 1, sin 0
    partner, pair, first = rope_pairs(c, ROPE, INTERLEAVED)
    in_rope = c < ROPE
    partner = tl.where(in_rope, partner, c)
    mean = tl.zeros((ROWS,), tl.float32)
    rstd = tl.zeros((ROWS,), tl.float32)
    if NORM:
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + c[None, :], mask=live[:, None],
                    other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / DIM
        centered = x - mean[:, None]
        rstd = 1.0 / tl.sqrt_rn(tl.sum(centered * centered, axis=1) / DIM + eps)
    x = _load_normed(x_ptr, rows, c, live, stride_x, mean, rstd, w_ptr, b_ptr, NORM, BF16)
    xp = _load_normed(x_ptr, rows, partner, live, stride_x, mean, rstd, w_ptr, b_ptr, NORM, BF16)
    token = rows // heads
    angle = token[:, None].to(tl.int64) * stride_cos + pair[None, :]
    rope_mask = live[:, None] & in_rope[None, :]
    cos = tl.load(cos_ptr + angle, mask=rope_mask, other=1.0)
    sin = tl.load(sin_ptr + angle, mask=rope_mask, other=0.0)
    sin = tl.where(first[None, :], -sin, sin)
    y = _round(x * cos + xp * sin, BF16)
    if ROTATE:
        # y @ H by the fast Walsh-Hadamard transform: a stage adds and subtracts the column pairs
        # that differ in bit 0, then rotates the column bits right by one (the pair's bit becomes
        # bit 6), so after 7 stages every bit is done and the columns are back in order.
        tl.static_assert(DIM == 128)
        for _ in tl.static_range(7):
            a, b = tl.split(tl.reshape(y, (ROWS, DIM // 2, 2)))
            y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (ROWS, DIM))
        y = _round(y * 0.08838834764831845, BF16)
    if DEST == 0:
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + c[None, :],
                 y.to(out_ptr.dtype.element_ty), mask=live[:, None])
    else:
        slot = tl.load(loc_ptr + rows, mask=live, other=0).to(tl.int64)
        if DEST == 1:
            tl.store(out_ptr + slot[:, None] * stride_out + c[None, :], y.to(out_ptr.dtype.element_ty),
                     mask=live[:, None])
        else:
            q, s = quantize_rows(y, True)
            page, offset = slot // PAGE, slot % PAGE
            tl.store(out_ptr + (page * stride_out + offset * DIM)[:, None] + c[None, :],
                     q.to(out_ptr.dtype.element_ty), mask=live[:, None])
            tl.store(scale_ptr + page * stride_scale + offset, s, mask=live)


def _check_angles(cos, sin, tokens: int, rope_dim: int, device) -> None:
    if rope_dim < 2 or rope_dim % 2 or rope_dim > INDEX_HEAD_DIM:
        raise ValueError(f"rope_dim: expected an even number in [2, {INDEX_HEAD_DIM}], got {rope_dim}")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, dtype=(torch.float32,), shape=(tokens, rope_dim // 2), device=device)


def _launch(x, cos, sin, rope_dim, interleaved, rotate, heads, dest, out, loc=None, scale=None,
            weight=None, bias=None, eps=0.0):
    n = x.shape[0]
    if not n:
        return
    norm = weight is not None
    _index_rope_kernel[(triton.cdiv(n, _ROWS),)](
        x, cos, sin, weight if norm else x, bias if norm else x, out, loc if loc is not None else x,
        scale if scale is not None else x, n, heads, eps, x.stride(0), cos.stride(0), out.stride(0),
        scale.stride(0) if scale is not None else 0, ROWS=_ROWS, DIM=INDEX_HEAD_DIM, ROPE=rope_dim,
        INTERLEAVED=interleaved, NORM=norm, ROTATE=rotate, DEST=dest, BF16=x.dtype == torch.bfloat16,
        PAGE=PAGE_SIZE, enable_fp_fusion=False)


def index_q_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int, interleaved: bool,
                 rotate: bool) -> torch.Tensor:
    """The indexer query ``q`` ``[R, H, 128]`` (bf16 or fp32) with RoPE on its first ``rope_dim``
    values (``cos``/``sin`` fp32 ``[R, rope_dim / 2]``, one row per token) and, when ``rotate``,
    the Hadamard rotation (module docstring): a new tensor like ``q``."""
    check_tensor("q", q, dtype=_FLOAT_DTYPES, ndim=3, device=cos.device)
    if q.shape[-1] != INDEX_HEAD_DIM:
        raise ValueError(f"q: expected rows of {INDEX_HEAD_DIM} values, got {tuple(q.shape)}")
    _check_angles(cos, sin, q.shape[0], rope_dim, q.device)
    flat = q.reshape(-1, INDEX_HEAD_DIM)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch(flat, cos, sin, rope_dim, interleaved, rotate, q.shape[1], _OUT, out.view(-1, INDEX_HEAD_DIM))
    return out


def store_index_k_normed(cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int,
                         interleaved: bool, check_values: bool = True) -> None:
    """LayerNorm (``weight``, ``bias`` ``[128]``, ``eps``) then RoPE of the indexer keys ``k``
    ``[R, 128]`` (bf16 or fp32, before ``k_norm``), written at slots ``loc`` ``[R]`` of
    ``cache``: a copy into a dense cache ``[slots, 128]`` of ``k``'s dtype, or Hadamard-rotated
    and quantized into an FP8 paged cache (uint8 ``[pages, 8448]``). ``check_values``: ``loc``
    in range (host sync)."""
    check_tensor("k", k, dtype=_FLOAT_DTYPES, shape=(None, INDEX_HEAD_DIM), device=cos.device)
    for name, t in (("weight", weight), ("bias", bias)):
        check_tensor(name, t, dtype=_FLOAT_DTYPES, shape=(INDEX_HEAD_DIM,), device=k.device)
    check_tensor("loc", loc, dtype=_INDEX_DTYPES, shape=(k.shape[0],), device=k.device)
    _check_angles(cos, sin, k.shape[0], rope_dim, k.device)
    fp8 = is_fp8_cache(cache)
    if fp8:
        codes, scale = index_k_fp8_views(cache)
        num_slots = cache.shape[0] * PAGE_SIZE
    else:
        check_tensor("cache", cache, dtype=(k.dtype,), shape=(None, INDEX_HEAD_DIM), device=k.device)
        codes, scale, num_slots = cache, None, cache.shape[0]
    if check_values and loc.numel() and (int(loc.min()) < 0 or int(loc.max()) >= num_slots):
        raise ValueError(f"loc: slots must lie in [0, {num_slots}), got [{int(loc.min())}, {int(loc.max())}]")
    _launch(k, cos, sin, rope_dim, interleaved, fp8, 1, _FP8 if fp8 else _DENSE, codes, loc=loc, scale=scale,
            weight=weight, bias=bias, eps=eps)
