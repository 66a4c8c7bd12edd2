"""The indexer's head weights in one kernel (Triton): ``weights_proj`` in fp32 and its scale,

    out[r, h] = (sum_k float(x[r, k]) * float(W[h, k])) * scale      (fp32 products and sums)

as HF runs that module (``_keep_in_fp32_modules``: the input cast to fp32, an fp32 GEMM, then
``index_head_dim**-0.5 * index_n_heads**-0.5``). A skinny GEMM (N = the index heads, K = hidden,
R = 1..256 rows): a program owns 8 rows and one head, keeps an fp32 ``[8, 256]`` tile of
elementwise products while it walks K (software-pipelined loads), and sums the tile's columns once
at the end, so that R x N programs fill the GPU at decode sizes (a tensor-core tile of 16 heads
left 4 programs at one row, each walking K alone). The tiles are fixed, so a row's bits never
depend on the other rows or the row count; the sums run in their own order against torch's GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaspec.ops.checks import check_tensor

_FLOAT_DTYPES = (torch.bfloat16, torch.float32)
_BLOCK_M, _BLOCK_K, _STAGES = 8, 256, 3


@triton.jit(do_not_specialize=["M"])
def _index_weights_kernel(x_ptr, w_ptr, out_ptr, M, K, scale, stride_x, stride_w, stride_out,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.program_id(1).to(tl.int64)
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :]
    w_ptrs = w_ptr + head * stride_w + ks
    products = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k_ok = k + ks < K
        x = tl.load(x_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptrs + k, mask=k_ok, other=0.0).to(tl.float32)
        products += x * w[None, :]
    tl.store(out_ptr + rows.to(tl.int64) * stride_out + head, tl.sum(products, 1) * scale, mask=row_ok)


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
        grid = (triton.cdiv(rows, _BLOCK_M), heads)
        _index_weights_kernel[grid](x, weight, out, rows, k, float(scale), x.stride(0), weight.stride(0),
                                    out.stride(0), BLOCK_M=_BLOCK_M, BLOCK_K=_BLOCK_K, STAGES=_STAGES)
    return out
