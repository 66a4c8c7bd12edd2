"""The MLA latent epilogue in one kernel (Triton): ``kv_a_layernorm`` (RMSNorm) on the 512-wide
latent, RoPE on the 64-wide key, and the cache write at the row's slot; and the absorbed query in
one kernel: ``q_nope`` times its head's ``W_UK`` (the 512-wide absorbed query) and the RoPE'd
64-wide ``q_rope`` of every head written side by side (``[R, H, 576]``, the sparse attention's
query), RoPE bit-identical to the torch ops'.

Per row ``[latent 512 | k_rope 64]`` of ``kv_a`` (model dtype; ``round`` rounds fp32 to the model
dtype, to nearest even):

    latent = round(x * rsqrt(sum(x * x) / 512 + eps) * w)       (fp32, no FMA)
    k_rope = round(RoPE(k_rope))    (pairs (2i, 2i+1) when interleaved, else (i, i + 32);
                                     fp32 x*cos - x'*sin, x*sin + x'*cos, no FMA)

then a copy into a dense cache ``[slots, 576]`` (rounded once more to the cache's dtype, as
``Tensor.to``), or the ``fp8_ds_mla`` write of :mod:`dsaspec.ops.fp8_kv`: the latent quantized per
128 values with a ue8m0 scale (:mod:`dsaspec.ops.e4m3`), the rope key as bf16. RoPE is
bit-identical to the torch ops; the norm's sum of squares runs in its own order (one ulp of the
model dtype). One program owns one row: a row's bits never depend on the other rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaspec.forward_mode import PREFILL_MIN_ROWS
from dsaspec.ops.checks import check_tensor
from dsaspec.ops.device import enter_chain, supports_pdl
from dsaspec.ops.e4m3 import quantize_rows
from dsaspec.ops.fp8_kv import _bf16_bits
from dsaspec.ops.index_rope import _round, rope_pairs
from dsaspec.ops.kv_cache_layout import FP8_GROUP, MLA_LATENT_DIM, MLA_ROPE_DIM, is_fp8_cache, mla_fp8_views

_FLOAT_DTYPES = (torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_WIDTH = MLA_LATENT_DIM + MLA_ROPE_DIM


@triton.jit
def _mla_latent_kernel(kv_ptr, w_ptr, cos_ptr, sin_ptr, loc_ptr, out_ptr, scale_ptr, rope_ptr, eps,
                       stride_kv, stride_cos, stride_out, stride_scale, stride_rope, GROUPS: tl.constexpr,
                       GROUP: tl.constexpr, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr,
                       FP8: tl.constexpr, BF16: tl.constexpr, CACHE_BF16: tl.constexpr, CHAINED: tl.constexpr):
    enter_chain(CHAINED)
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + row).to(tl.int64)
    x_row = kv_ptr + row * stride_kv
    latent_cols = tl.arange(0, GROUPS)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    x = tl.load(x_row + latent_cols).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / (GROUPS * GROUP) + eps)
    latent = _round(x * rstd * tl.load(w_ptr + latent_cols).to(tl.float32), BF16)

    r = tl.arange(0, ROPE)
    partner, pair, first = rope_pairs(r, ROPE, INTERLEAVED)
    k = tl.load(x_row + GROUPS * GROUP + r).to(tl.float32)
    kp = tl.load(x_row + GROUPS * GROUP + partner).to(tl.float32)
    cos = tl.load(cos_ptr + row * stride_cos + pair)
    sin = tl.load(sin_ptr + row * stride_cos + pair)
    k_rope = _round(k * cos + kp * tl.where(first, -sin, sin), BF16)

    if FP8:
        q, s = quantize_rows(latent, True)
        tl.store(out_ptr + slot * stride_out + latent_cols, q.to(out_ptr.dtype.element_ty))
        tl.store(scale_ptr + slot * stride_scale + tl.arange(0, GROUPS), s)
        tl.store(rope_ptr + slot * stride_rope + r, _bf16_bits(k_rope))
    else:
        tl.store(out_ptr + slot * stride_out + latent_cols,
                 _round(latent, CACHE_BF16).to(out_ptr.dtype.element_ty))
        tl.store(out_ptr + slot * stride_out + GROUPS * GROUP + r,
                 _round(k_rope, CACHE_BF16).to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["rows"])
def _mla_query_kernel(q_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, rows, m_tiles, stride_qr, stride_qh, stride_wh,
                      stride_wk, stride_cos, stride_or, stride_oh, NOPE: tl.constexpr, LATENT: tl.constexpr,
                      ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, BF16: tl.constexpr, UPCAST: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRODUCT: tl.constexpr,
                      CHAINED: tl.constexpr):
    # Row tiles vary fastest, so the programs that read one W_UK tile run together; the last column
    # program of each (row tile, head) rotates q_rope instead (every program when not PRODUCT).
    enter_chain(CHAINED)
    pid = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    pid_m = pid % m_tiles
    pid_n = pid // m_tiles
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = r < rows
    q_rows = q_ptr + r.to(tl.int64)[:, None] * stride_qr + head * stride_qh
    out_rows = out_ptr + r.to(tl.int64)[:, None] * stride_or + head * stride_oh
    if PRODUCT and pid_n < LATENT // BLOCK_N:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        w_cols = w_ptr + head * stride_wh + cols[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.static_range(0, NOPE, BLOCK_K):
            k_ok = (k + ks) < NOPE
            a = tl.load(q_rows + (k + ks)[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_cols + (k + ks)[:, None] * stride_wk, mask=k_ok[:, None], other=0.0)
            if UPCAST:  # the interpreter's bf16 dot multiplies the raw bits
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        tl.store(out_rows + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=r_ok[:, None])
    else:
        c = tl.arange(0, ROPE)
        partner, pair, first = rope_pairs(c, ROPE, INTERLEAVED)
        x = tl.load(q_rows + NOPE + c[None, :], mask=r_ok[:, None], other=0.0).to(tl.float32)
        xp = tl.load(q_rows + NOPE + partner[None, :], mask=r_ok[:, None], other=0.0).to(tl.float32)
        angle = r.to(tl.int64)[:, None] * stride_cos + pair[None, :]
        cos = tl.load(cos_ptr + angle, mask=r_ok[:, None], other=0.0)
        sin = tl.load(sin_ptr + angle, mask=r_ok[:, None], other=0.0)
        y = _round(x * cos + xp * tl.where(first[None, :], -sin, sin), BF16)
        tl.store(out_rows + LATENT + c[None, :], y.to(out_ptr.dtype.element_ty), mask=r_ok[:, None])


def decode_tiles(rows: int, row_invariant: bool) -> bool:
    """Whether MLA's absorption products of ``rows`` rows take their decode forms: :func:`mla_query`'s
    16-row tiles and, in the layer, W_UV's product on the row-invariant GEMM. Below ``PREFILL_MIN_ROWS``
    rows (every captured step), and at every row count when ``row_invariant``."""
    return row_invariant or rows < PREFILL_MIN_ROWS


# (BLOCK_M, BLOCK_N, num_warps, num_stages) of mla_query's decode and prefill tiles
DECODE_TILE = (16, 32, 4, 3)
PREFILL_TILE = (64, 128, 4, 3)


def mla_query_tiles(rows: int, dtype: torch.dtype, row_invariant: bool) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` of :func:`mla_query`: ``DECODE_TILE``
    where :func:`decode_tiles` (each row's bits then never depend on the row count), else
    ``PREFILL_TILE``; K blocks of 64 (bf16) or 32 (fp32)."""
    block_m, block_n, warps, stages = DECODE_TILE if decode_tiles(rows, row_invariant) else PREFILL_TILE
    return block_m, block_n, 64 if dtype == torch.bfloat16 else 32, warps, stages


def mla_query(q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
              row_invariant: bool = False) -> torch.Tensor:
    """The absorbed query ``[R, H, 576]`` (a new contiguous tensor in ``q``'s dtype) from ``q``
    ``[R, H, D + 64]`` (``q_b_proj``'s output: ``q_nope`` then ``q_rope``) and ``w_uk`` ``[H, D, 512]``:

        out[r, h, :512] = round(sum_d q[r, h, d] * w_uk[h, d, :])     (fp32 sum in K blocks, in order)
        out[r, h, 512:] = round(RoPE(q[r, h, D:]))

    RoPE by the row's ``cos``/``sin`` fp32 ``[R, 32]`` (pairs ``(2i, 2i+1)`` when ``interleaved``,
    else ``(i, i + 32)``; fp32 ``x*cos - x'*sin``, ``x*sin + x'*cos`` without FMA), bit-identical to
    the torch ops; the product's sum order is :func:`mla_query_tiles`'s, so a row's bits depend on
    the row count only in prefill chunks and never with ``row_invariant``. ``q`` and ``w_uk`` both bf16
    or both fp32, any strides with a unit last stride (``q`` a column view of a fused GEMM's output,
    ``w_uk`` a view of ``kv_b_proj``'s weight)."""
    check_tensor("q", q, dtype=_FLOAT_DTYPES, ndim=3, device=cos.device)
    rows, heads, width = q.shape
    nope = width - MLA_ROPE_DIM
    if nope < 1:
        raise ValueError(f"q: expected a last dim of qk_nope_head_dim + {MLA_ROPE_DIM}, got {width}")
    check_tensor("w_uk", w_uk, dtype=(q.dtype,), shape=(heads, nope, MLA_LATENT_DIM), device=cos.device)
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, dtype=(torch.float32,), shape=(rows, MLA_ROPE_DIM // 2), device=cos.device)
    if cos.stride() != sin.stride():
        raise ValueError(f"sin: expected the strides of cos {cos.stride()}, got {sin.stride()}")
    out = torch.empty(rows, heads, _WIDTH, dtype=q.dtype, device=q.device)
    launch_mla_query(q, w_uk, cos, sin, interleaved, out, mla_query_tiles(rows, q.dtype, row_invariant), True)
    return out


def launch_mla_query(q, w_uk, cos, sin, interleaved: bool, out, tiles: tuple[int, int, int, int, int],
                     product: bool) -> None:
    """:func:`mla_query`'s kernel on checked inputs with ``tiles`` (:func:`mla_query_tiles`' form) into
    ``out``; without ``product`` only ``out[..., 512:]`` (the RoPE) is written."""
    rows, heads = q.shape[:2]
    if not rows or not heads:
        return
    block_m, block_n, block_k, warps, stages = tiles
    m_tiles = triton.cdiv(rows, block_m)
    chained = supports_pdl(q.device)
    _mla_query_kernel[(m_tiles * (MLA_LATENT_DIM // block_n + 1 if product else 1), heads)](
        q, w_uk, cos, sin, out, rows, m_tiles, q.stride(0), q.stride(1), w_uk.stride(0), w_uk.stride(1),
        cos.stride(0), out.stride(0), out.stride(1), NOPE=q.shape[2] - MLA_ROPE_DIM, LATENT=MLA_LATENT_DIM,
        ROPE=MLA_ROPE_DIM, INTERLEAVED=interleaved, BF16=q.dtype == torch.bfloat16, UPCAST=not out.is_cuda,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRODUCT=product, CHAINED=chained, launch_pdl=chained,
        enable_fp_fusion=False, num_warps=warps, num_stages=stages)


def store_mla_normed(cache: torch.Tensor, loc: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor, eps: float,
                     cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, check_values: bool = True) -> None:
    """RMSNorm (``weight`` ``[512]``, ``eps``) of the latent and RoPE (``cos``/``sin`` fp32
    ``[R, 32]``) of the rope key of ``kv`` ``[R, 576]`` (bf16 or fp32, the ``kv_a`` projection
    before ``kv_a_layernorm``; unit last stride, any row stride), written at slots ``loc`` ``[R]``
    of ``cache``: a dense cache ``[slots, 576]`` (bf16 or fp32) or an ``fp8_ds_mla`` cache (uint8
    ``[slots, 656]``, quantized on write). ``check_values``: ``loc`` in range (host sync)."""
    check_tensor("kv", kv, dtype=_FLOAT_DTYPES, shape=(None, _WIDTH), device=cos.device)
    rows = kv.shape[0]
    check_tensor("weight", weight, dtype=_FLOAT_DTYPES, shape=(MLA_LATENT_DIM,), device=kv.device)
    check_tensor("loc", loc, dtype=_INDEX_DTYPES, shape=(rows,), device=kv.device)
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, dtype=(torch.float32,), shape=(rows, MLA_ROPE_DIM // 2), device=kv.device)
    if cos.stride() != sin.stride():
        raise ValueError(f"sin: expected the strides of cos {cos.stride()}, got {sin.stride()}")
    fp8 = is_fp8_cache(cache)
    if fp8:
        out, scale, rope = mla_fp8_views(cache)
    else:
        check_tensor("cache", cache, dtype=_FLOAT_DTYPES, shape=(None, _WIDTH), device=kv.device)
        out = scale = rope = cache
    if check_values and rows and (int(loc.min()) < 0 or int(loc.max()) >= cache.shape[0]):
        raise ValueError(f"loc: slots must lie in [0, {cache.shape[0]}), got [{int(loc.min())}, {int(loc.max())}]")
    if not rows:
        return
    chained = supports_pdl(kv.device)
    _mla_latent_kernel[(rows,)](
        kv, weight, cos, sin, loc, out, scale, rope.view(torch.int16) if fp8 else rope, float(eps), kv.stride(0),
        cos.stride(0), out.stride(0), scale.stride(0), rope.stride(0), GROUPS=MLA_LATENT_DIM // FP8_GROUP,
        GROUP=FP8_GROUP, ROPE=MLA_ROPE_DIM, INTERLEAVED=interleaved, FP8=fp8, BF16=kv.dtype == torch.bfloat16,
        CACHE_BF16=cache.dtype == torch.bfloat16, CHAINED=chained, launch_pdl=chained, enable_fp_fusion=False)
