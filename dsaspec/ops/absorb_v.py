"""The MLA output's value absorption and ``o_proj``'s activation quantization in one launch.

Sparse MLA returns each row's attention output in the latent space, ``o_latent [R, H, L]``
(``L = kv_lora_rank``, 512); the absorbed ``W_UV [H, V, L]`` (``kv_b_proj``'s value rows) takes it
to ``o[r, h, :] = W_UV[h] @ o_latent[r, h]`` (``V = v_head_dim``), and ``o_proj`` reads
``o [R, H * V]``. With an FP8 ``o_proj`` that is a bmm, then an ``act_quant`` launch, then the
GEMM on the codes. Here one program computes a 128-column block of one head's ``o`` for 16 rows
(fp32 sums over ``L`` in blocks of 64, rounded once to bf16: what ``torch.bmm`` stores) and writes
those values and their ``act_quant`` codes and scale (each 128-column block lies in one head,
``V`` being a multiple of 128), so ``o_proj`` runs :func:`~dsaspec.ops.fp8_gemm.fp8_gemm` on them
next. A row's results depend on its own inputs only (row-invariant by construction).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaspec.ops.checks import check_tensor
from dsaspec.ops.e4m3 import quantize_rows
from dsaspec.ops.fp8_gemm import BLOCK, SCALE_FORMATS

_ROWS = 16      # rows a program: the smallest tl.dot tile
_BLOCK_L = 64   # latent values a K step


@triton.jit(do_not_specialize=["R"])   # one compile for every row count (R = 1 would otherwise be its own)
def _absorb_v_quant_kernel(o_ptr, w_ptr, y_ptr, q_ptr, s_ptr, R, L, stride_or, stride_oh, stride_wh, stride_wv,
                           stride_y, stride_q, stride_s, V: tl.constexpr, QBLOCK: tl.constexpr,
                           ROWS: tl.constexpr, BLOCK_L: tl.constexpr, UE8M0: tl.constexpr, UPCAST: tl.constexpr):
    # program (i, h, c): rows [16 i, 16 i + 16), head h, its value columns [128 c, 128 c + 128);
    # acc = the sum over the L blocks, in order, of their dots.
    # UPCAST (CPU tensors): the interpreter's dot misreads bf16, so both sides go to fp32 first
    # (the products of bf16 values are exact in fp32 either way)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    head = tl.program_id(1)
    block = tl.program_id(2)
    cols = block * QBLOCK + tl.arange(0, QBLOCK)
    live = rows < R
    ls = tl.arange(0, BLOCK_L)
    o_ptrs = o_ptr + rows[:, None].to(tl.int64) * stride_or + head * stride_oh + ls[None, :]
    w_ptrs = w_ptr + head.to(tl.int64) * stride_wh + cols[None, :] * stride_wv + ls[:, None]   # [BLOCK_L, 128]
    acc = tl.zeros((ROWS, QBLOCK), dtype=tl.float32)
    for _ in range(0, L, BLOCK_L):
        a = tl.load(o_ptrs, mask=live[:, None], other=0.0)
        w = tl.load(w_ptrs)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc)
        o_ptrs += BLOCK_L
        w_ptrs += BLOCK_L
    y = acc.to(y_ptr.dtype.element_ty)
    out_cols = head * V + cols
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + out_cols[None, :], y, mask=live[:, None])
    codes, scales = quantize_rows(y.to(tl.float32), UE8M0)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_q + out_cols[None, :], codes.to(q_ptr.dtype.element_ty),
             mask=live[:, None])
    tl.store(s_ptr + rows.to(tl.int64) * stride_s + head * (V // QBLOCK) + block, scales, mask=live)


def fits(v: int, latent: int) -> bool:
    """Whether :func:`absorb_v_quant` takes ``V`` value columns a head (a multiple of 128) and ``L``
    latent values (a multiple of 64)."""
    return v >= BLOCK and v % BLOCK == 0 and latent >= _BLOCK_L and latent % _BLOCK_L == 0


def absorb_v_quant(o_latent: torch.Tensor, w_uv: torch.Tensor, scale_fmt: str | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``o[r, h * V + v] = bf16(sum_l o_latent[r, h, l] * w_uv[h, v, l])`` (fp32 sums) and its
    :func:`~dsaspec.ops.fp8_gemm.act_quant` with ``scale_fmt`` (None or ``"ue8m0"``), in one launch.

    ``o_latent``: bf16 ``[R, H, L]`` (unit last stride); ``w_uv``: bf16 ``[H, V, L]`` (unit last
    stride, any head / row strides: a view of ``kv_b_proj``'s weight), ``V`` a multiple of 128 and
    ``L`` of 64. Returns new ``o`` bf16 ``[R, H * V]``, ``codes`` e4m3 ``[R, H * V]`` and
    ``scales`` fp32 ``[R, H * V / 128]``, bitwise ``act_quant(o, scale_fmt)``. No host sync."""
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"scale_fmt: expected one of {SCALE_FORMATS}, got {scale_fmt!r}")
    check_tensor("o_latent", o_latent, dtype=torch.bfloat16, ndim=3)
    rows, heads, latent = o_latent.shape
    check_tensor("w_uv", w_uv, dtype=torch.bfloat16, ndim=3, device=o_latent.device)
    if w_uv.shape[0] != heads or w_uv.shape[2] != latent:
        raise ValueError(f"w_uv: expected shape ({heads}, V, {latent}) for o_latent of shape "
                         f"{tuple(o_latent.shape)}, got {tuple(w_uv.shape)}")
    v = w_uv.shape[1]
    if v < BLOCK or v % BLOCK:
        raise ValueError(f"w_uv: V = {v} must be a positive multiple of {BLOCK} (the FP8 quantization block)")
    if latent < _BLOCK_L or latent % _BLOCK_L:
        raise ValueError(f"o_latent: L = {latent} must be a positive multiple of {_BLOCK_L}")
    o = torch.empty(rows, heads * v, dtype=torch.bfloat16, device=o_latent.device)
    codes = torch.empty(rows, heads * v, dtype=torch.float8_e4m3fn, device=o_latent.device)
    scales = torch.empty(rows, heads * v // BLOCK, dtype=torch.float32, device=o_latent.device)
    if rows == 0 or heads == 0:
        return o, codes, scales
    _absorb_v_quant_kernel[(triton.cdiv(rows, _ROWS), heads, v // BLOCK)](
        o_latent, w_uv, o, codes, scales, rows, latent, o_latent.stride(0), o_latent.stride(1), w_uv.stride(0),
        w_uv.stride(1), o.stride(0), codes.stride(0), scales.stride(0), V=v, QBLOCK=BLOCK, ROWS=_ROWS,
        BLOCK_L=_BLOCK_L, UE8M0=scale_fmt == "ue8m0", UPCAST=not o_latent.is_cuda, num_warps=4)
    return o, codes, scales
