"""FP8 block-scaled linear algebra of the DeepSeek-V3 / V3.2 / GLM-5 FP8 checkpoints: per-token
activation quantization and the block-scaled GEMM ``y = (A_q * a_scale) @ (W_q * w_scale)^T``.

The format (``quantization_config {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128]}``):
a weight ``W [N, K]`` is stored as ``weight`` e4m3 (``torch.float8_e4m3fn``) and
``weight_scale_inv`` fp32 ``[ceil(N / 128), K / 128]``, one scale per 128 x 128 block, with
``W[n, k] ~= weight[n, k] * weight_scale_inv[n // 128, k // 128]`` (DeepSeek's ``weight_dequant``).
Activations are quantized at run time per token per 128 columns (DeepSeek's ``act_quant``), and the
GEMM accumulates each 128-column K block in fp32 and scales it by ``a_scale[m, kb] * w_scale[nb, kb]``
(DeepSeek's ``fp8_gemm``).

Activation scales, as the reference ``inference/kernel.py`` files compute them:

* DeepSeek-V3 (Triton ``act_quant``): ``s = amax / 448`` (448: the e4m3 maximum), fp32, not
  rounded, no floor (an all-zero block gives ``s = 0`` and NaN values), ``q = e4m3(x / s)``.
* DeepSeek-V3.2 (tilelang ``act_quant``): ``amax = max(amax, 1e-4)``; with ``scale_fmt`` None
  ``s = amax * fp32(1 / 448)``, with ``scale_fmt`` set (its ``config.json`` has ``"scale_fmt":
  "ue8m0"``) ``s = 2 ** ceil(log2(amax / 448))``, a power of two (UE8M0: exponent only), computed on
  the fp32 bits; ``q = e4m3(clamp(x / s, -448, 448))``; scales stored fp32 either way.

This module follows V3.2 (floor 1e-4, clamp) with V3's correctly rounded ``amax / 448`` for fp32
scales (V3.2's multiply by ``fp32(1 / 448)`` may differ from it in the last bit):

    amax = max(max |x[m, 128 kb : 128 kb + 128]|, 1e-4)
    s    = amax / 448                              scale_fmt None (fp32, correctly rounded)
    s    = 2 ** ceil(log2(amax / 448))             scale_fmt "ue8m0"
    q    = e4m3_rne(clamp(x / s, -448, 448))       x / s correctly rounded; a zero code is +0

A block holding a NaN or an infinity gets ``s = NaN`` and ``q = 0``, so every output of its row is
NaN (a non-finite activation never turns into finite garbage). Weights are quantized the same way
per 128 x 128 block (:func:`quantize_weight`, fp32 scales). The kernel quantizes with the device
functions of :mod:`dsaspec.ops.e4m3`, which round ``x / s`` to the e4m3 grid before the cast, so
the codes are the same on the GPU and under the Triton interpreter.

:func:`fp8_linear` runs either two launches (:func:`act_quant`, then :func:`fp8_gemm`) or one: the
GEMM kernel with ``QUANTIZE_A`` loads the bf16 / fp32 rows of its tile one 128-column K block at a
time, quantizes them with the same device function and feeds the codes and scales to the same dot,
so both forms give the same bits. The fused form redoes the quantization in every N program, so
it serves the small M and K of some decode layers (``FUSED_QUANT_MAX_M``, ``FUSED_QUANT_MAX_K``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaspec.ops.checks import check_count, check_tensor
from dsaspec.ops.e4m3 import quantize_rows

BLOCK = 128              # quantization block: 128 columns of a token, 128 x 128 of a weight
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
SCALE_FORMATS = (None, "ue8m0")
_ACT_DTYPES = (torch.bfloat16, torch.float32)
_OUT_DTYPES = (torch.bfloat16, torch.float32)
_QUANT_ROWS = 16         # rows per act_quant program
# One GEMM tile for every M, so each output row is computed the same way whatever the other rows
# are (row-invariant by construction): a token's result does not depend on the batch.
_GEMM_BLOCK_M, _GEMM_BLOCK_N = 16, 64
# fp8_linear quantizes inside the GEMM for M <= FUSED_QUANT_MAX_M and K <= FUSED_QUANT_MAX_K. Every
# N program quantizes its 16 rows again: on sm_90 a K step is ~900 SASS instructions instead of
# ~170, ~730 more issue cycles per warp (4 warps on 4 schedulers), ~0.37 us a K step at 1.98 GHz,
# against one act_quant launch saved (a few us): a gain up to K 512 (4 K steps) with one row
# block (M <= 16; more rows multiply the programs), a loss at K 1536 - 7168.
FUSED_QUANT_MAX_M = 16
FUSED_QUANT_MAX_K = 512


def _check_scale_fmt(scale_fmt) -> None:
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"scale_fmt: expected one of {SCALE_FORMATS}, got {scale_fmt!r}")


def _check_k(name: str, k: int) -> None:
    if k < BLOCK or k % BLOCK:
        raise ValueError(f"{name}: K = {k} must be a positive multiple of {BLOCK} (the FP8 quantization block)")


@triton.jit(do_not_specialize=["M"])
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, stride_xm, stride_qm, stride_sm,
                      UE8M0: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    kb = tl.program_id(1)
    cols = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    live = rows < M
    mask = live[:, None]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask, other=0.0)
    y, s = quantize_rows(x.to(tl.float32), UE8M0)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], y.to(q_ptr.dtype.element_ty),
             mask=mask)
    tl.store(s_ptr + rows.to(tl.int64) * stride_sm + kb, s, mask=live)


def act_quant(x: torch.Tensor, scale_fmt: str | None = None, *, out: torch.Tensor | None = None,
              scale_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations per token per 128 columns (module docstring for the math).

    ``x``: bf16 or fp32 ``[M, K]`` (last dim contiguous), ``K`` a multiple of 128. ``scale_fmt``:
    None (fp32 scales) or ``"ue8m0"`` (power-of-two scales). Writes and returns ``out`` e4m3
    ``[M, K]`` and ``scale_out`` fp32 ``[M, K / 128]`` (allocated when None). No host sync."""
    _check_scale_fmt(scale_fmt)
    m, k = _check_x(x)
    if out is None:
        out = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    if scale_out is None:
        scale_out = torch.empty(m, k // BLOCK, dtype=torch.float32, device=x.device)
    check_tensor("out", out, dtype=torch.float8_e4m3fn, shape=(m, k), device=x.device)
    check_tensor("scale_out", scale_out, dtype=torch.float32, shape=(m, k // BLOCK), device=x.device)
    grid = (triton.cdiv(m, _QUANT_ROWS), k // BLOCK)
    _act_quant_kernel[grid](x, out, scale_out, m, x.stride(0), out.stride(0), scale_out.stride(0),
                            UE8M0=scale_fmt == "ue8m0", ROWS=_QUANT_ROWS, BLOCK_K=BLOCK)
    return out, scale_out


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, M, N, K,
                     stride_am, stride_asm, stride_wn, stride_wsn, stride_cm,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     QUANTIZE_A: tl.constexpr, UE8M0: tl.constexpr):
    # QUANTIZE_A: a holds bf16 / fp32 activations (as_ptr unread), quantized per K block in
    # registers exactly as _act_quant_kernel does, so the dot sees act_quant's codes and scales
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n0 = tl.program_id(1) * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_live = rows < M
    col_live = cols < N
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :]
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]       # [BLOCK_K, BLOCK_N]
    as_ptrs = as_ptr + rows.to(tl.int64) * stride_asm
    ws_ptrs = ws_ptr + (n0 // BLOCK_K) * stride_wsn       # BLOCK_N divides 128: one scale row per tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // BLOCK_K):
        a = tl.load(a_ptrs, mask=row_live[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=col_live[None, :], other=0.0)
        if QUANTIZE_A:
            codes, a_s = quantize_rows(a.to(tl.float32), UE8M0)
            a = codes.to(w_ptr.dtype.element_ty)
        else:
            a_s = tl.load(as_ptrs + kb, mask=row_live, other=0.0)
        w_s = tl.load(ws_ptrs + kb)
        acc += tl.dot(a, w) * (a_s[:, None] * w_s)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_live[:, None] & col_live[None, :])


def _check_x(x: torch.Tensor) -> tuple[int, int]:
    check_tensor("x", x, dtype=_ACT_DTYPES, ndim=2)
    m, k = x.shape
    check_count("x.shape[0] (M)", m)
    _check_k("x", k)
    return m, k


def _gemm(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor,
          out: torch.Tensor | None, out_dtype: torch.dtype, scale_fmt: str | None) -> torch.Tensor:
    """Check ``w``, ``w_scale``, ``out`` against ``a [M, K]`` (already checked) and launch the
    GEMM; ``a_scale`` None: ``a`` is bf16 / fp32, quantized in the kernel with ``scale_fmt``."""
    m, k = a.shape
    check_tensor("w", w, dtype=torch.float8_e4m3fn, ndim=2)
    n = w.shape[0]
    check_count("w.shape[0] (N)", n)
    check_tensor("w", w, dtype=torch.float8_e4m3fn, shape=(n, k), device=a.device)
    check_tensor("w_scale", w_scale, dtype=torch.float32, shape=(triton.cdiv(n, BLOCK), k // BLOCK),
                 device=a.device)
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype: expected one of {_OUT_DTYPES}, got {out_dtype}")
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if out.dtype not in _OUT_DTYPES:
        raise ValueError(f"out: expected dtype in {_OUT_DTYPES}, got {out.dtype}")
    check_tensor("out", out, dtype=out.dtype, shape=(m, n), device=a.device)
    quantize = a_scale is None
    if quantize:
        a_scale = a                                       # unread
    grid = (triton.cdiv(m, _GEMM_BLOCK_M), triton.cdiv(n, _GEMM_BLOCK_N))
    _fp8_gemm_kernel[grid](a, a_scale, w, w_scale, out, m, n, k,
                           a.stride(0), a_scale.stride(0), w.stride(0), w_scale.stride(0), out.stride(0),
                           BLOCK_M=_GEMM_BLOCK_M, BLOCK_N=_GEMM_BLOCK_N, BLOCK_K=BLOCK,
                           QUANTIZE_A=quantize, UE8M0=scale_fmt == "ue8m0", num_warps=4, num_stages=3)
    return out


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, *,
             out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Block-scaled FP8 GEMM: ``out[m, n] = sum_kb a_scale[m, kb] * w_scale[n // 128, kb] *
    sum_{k in block kb} a[m, k] * w[n, k]``, each block's dot accumulated in fp32, the sum over
    blocks in fp32 in K order.

    ``a``: e4m3 ``[M, K]`` with ``a_scale`` fp32 ``[M, K / 128]`` (:func:`act_quant`); ``w``: e4m3
    ``[N, K]`` with ``w_scale`` fp32 ``[ceil(N / 128), K / 128]`` (a checkpoint's ``weight`` and
    ``weight_scale_inv``); ``K`` a multiple of 128, any ``N >= 1``, any ``M >= 1`` (tuned for the
    decode / verify sizes 1..512). Writes and returns ``out`` ``[M, N]`` (``out_dtype`` bf16 or
    fp32; allocated when None). One tile shape for every ``M``: each row's result is bitwise
    independent of the other rows. No host sync."""
    check_tensor("a", a, dtype=torch.float8_e4m3fn, ndim=2)
    m, k = a.shape
    check_count("a.shape[0] (M)", m)
    _check_k("a", k)
    check_tensor("a_scale", a_scale, dtype=torch.float32, shape=(m, k // BLOCK), device=a.device)
    return _gemm(a, a_scale, w, w_scale, out, out_dtype, None)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, scale_fmt: str | None = None, *,
               out: torch.Tensor | None = None, fuse_quant: bool | None = None) -> torch.Tensor:
    """``x @ W^T`` for an FP8 block-scaled ``W`` (``w`` e4m3 ``[N, K]``, ``w_scale``
    ``[ceil(N / 128), K / 128]``): ``x`` (bf16 or fp32 ``[M, K]``, unit last stride) quantized as
    :func:`act_quant` does, then the :func:`fp8_gemm` product; writes and returns ``out`` ``[M, N]``
    in ``x``'s dtype. ``fuse_quant`` True: one launch, each GEMM program quantizing its rows' K
    blocks in registers; False: :func:`act_quant` then :func:`fp8_gemm`; None (default): fused for
    ``M <= FUSED_QUANT_MAX_M`` and ``K <= FUSED_QUANT_MAX_K``. Both give the same bits, so each
    row's result is independent of M."""
    _check_scale_fmt(scale_fmt)
    m, k = _check_x(x)
    if fuse_quant is None:
        fuse_quant = m <= FUSED_QUANT_MAX_M and k <= FUSED_QUANT_MAX_K
    if fuse_quant:
        return _gemm(x, None, w, w_scale, out, x.dtype, scale_fmt)
    q, s = act_quant(x, scale_fmt)
    return fp8_gemm(q, s, w, w_scale, out=out, out_dtype=x.dtype)


def quantize_blocks(x: torch.Tensor, block_rows: int, scale_fmt: str | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch quantization of ``x [N, K]`` (float, ``K`` a multiple of 128) per
    ``block_rows`` x 128 block, with :func:`act_quant`'s math (the floor, ``scale_fmt``, the clamp,
    +0 for a zero code, scale NaN and codes 0 for a block with NaN or inf): ``block_rows`` 1 is
    :func:`act_quant` (eager, any device), 128 the weights' blocks (a partial last block uses its
    rows). Returns e4m3 ``[N, K]`` and fp32 ``[ceil(N / block_rows), K / 128]``."""
    _check_scale_fmt(scale_fmt)
    n, k = x.shape
    _check_k("x", k)
    nb = triton.cdiv(n, block_rows)
    padded = torch.zeros(nb * block_rows, k, dtype=torch.float32, device=x.device)
    padded[:n] = x
    blocks = padded.view(nb, block_rows, k // BLOCK, BLOCK)
    bad = ~torch.isfinite(blocks).all(dim=3).all(dim=1)
    amax = blocks.abs().nan_to_num(0.0, 0.0, 0.0).amax(dim=(1, 3)).clamp_min(AMAX_FLOOR)
    # A tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal, which can
    # differ from the correctly rounded quotient in the last bit.
    scale = amax / torch.full_like(amax, E4M3_MAX)
    if scale_fmt == "ue8m0":
        bits = scale.view(torch.int32)
        exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        scale = (exponent << 23).view(torch.float32)
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    q = torch.where(bad[:, None, :, None], 0.0, q)
    q = q.view(nb * block_rows, k)[:n].to(torch.float8_e4m3fn)
    bits = q.view(torch.uint8)
    bits.masked_fill_(bits == 0x80, 0)                                  # -0 -> +0
    return q, torch.where(bad, torch.nan, scale)


@torch.no_grad()
def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float ``weight [N, K]`` (``K`` a multiple of 128) per 128 x 128 block
    (:func:`quantize_blocks`, fp32 scales): e4m3 ``[N, K]`` and ``weight_scale_inv``
    ``[ceil(N / 128), K / 128]``. Raises ``ValueError`` for a non-finite weight."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight: expected a 2-D float tensor, got {getattr(weight, 'shape', weight)!r}")
    _check_k("weight", weight.shape[1])
    if not torch.isfinite(weight).all():
        raise ValueError("weight: holds NaN or infinite values; FP8 block scales need finite weights")
    return quantize_blocks(weight, BLOCK)


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight [N, K]`` e4m3 times its block scales ``[ceil(N / 128), K / 128]`` (fp32 math),
    as ``dtype``. Plain torch, no host sync (graph-capturable)."""
    n, k = weight.shape
    expanded = scale.repeat_interleave(BLOCK, dim=0)[:n].repeat_interleave(BLOCK, dim=1)
    return (weight.float() * expanded).to(dtype)
