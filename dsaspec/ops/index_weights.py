"""The indexer's head weights in one kernel (Triton): ``weights_proj`` in fp32 and its scale,

    out[r, h] = (sum_k float(x[r, k]) * float(W[h, k])) * scale      (fp32 products and sums)

as HF runs that module (``_keep_in_fp32_modules``: the input cast to fp32, an fp32 GEMM, then
``index_head_dim**-0.5 * index_n_heads**-0.5``). A skinny GEMM (N = the index heads, K = hidden):
a program owns 16 rows x 16 heads and walks K in blocks of 128, in order, with an fp32 IEEE dot
(FMA, no TF32), so a row's bits never depend on the other rows or the row count. The sums run in
their own order against torch's GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaspec.ops.checks import check_tensor

_FLOAT_DTYPES = (torch.bfloat16, torch.float32)
_BLOCK_M, _BLOCK_N, _BLOCK_K = 16, 16, 128


@triton.jit(do_not_specialize=["M"])
def _index_weights_kernel(x_ptr, w_ptr, out_ptr, M, N, K, scale, stride_x, stride_w, stride_out,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    heads = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, head_ok = rows < M, heads < N
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :]
    w_ptrs = w_ptr + heads.to(tl.int64)[None, :] * stride_w + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = k + ks < K
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & head_ok[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision="ieee")
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + heads[None, :], acc * scale,
             mask=row_ok[:, None] & head_ok[None, :])


def index_weights(x: torch.Tensor, weight: torch.Tensor, scale: float) -> torch.Tensor:
    """``(x.float() @ weight.float().T) * scale``: ``x`` ``[R, K]`` (bf16 or fp32, unit last
    stride, any row stride), ``weight`` ``[N, K]`` (bf16 or fp32, unit last stride) -> a new fp32
    tensor ``[R, N]`` (module docstring)."""
    check_tensor("x", x, dtype=_FLOAT_DTYPES, ndim=2)
    rows, k = x.shape
    check_tensor("weight", weight, dtype=_FLOAT_DTYPES, shape=(None, k), device=x.device)
    heads = weight.shape[0]
    out = torch.empty(rows, heads, dtype=torch.float32, device=x.device)
    if rows and heads:
        grid = (triton.cdiv(rows, _BLOCK_M), triton.cdiv(heads, _BLOCK_N))
        _index_weights_kernel[grid](x, weight, out, rows, heads, k, float(scale), x.stride(0), weight.stride(0),
                                    out.stride(0), BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K)
    return out
