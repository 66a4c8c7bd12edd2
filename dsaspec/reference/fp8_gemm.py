"""Pure PyTorch definitions of the FP8 block-scaled ops (``dsaspec.ops.fp8_gemm``): the activation
and weight quantizers (bit-exact contracts: the ops' scales and, on the GPU, codes equal these),
the block dequantization and the dequantize-then-matmul GEMM in fp64 (the op accumulates in fp32,
so it matches within a tolerance)."""

from __future__ import annotations

import torch

GROUP = 128
FP8_MAX = 448.0
MIN_AMAX = 1e-4


def _power_of_two_ceil(s: torch.Tensor) -> torch.Tensor:
    """``2 ** ceil(log2(s))`` for positive finite fp32 ``s``, exactly (via frexp)."""
    mantissa, exponent = torch.frexp(s)            # s = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(s), exponent)


def _quantize_groups(groups: torch.Tensor, amax: torch.Tensor, ue8m0: bool):
    """Codes and scales of fp32 ``groups`` given their per-group ``amax`` (broadcastable); a code
    that rounds to zero is +0."""
    finite = torch.isfinite(amax)
    amax = torch.clamp(torch.where(finite, amax, 0.0), min=MIN_AMAX)
    # a tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal, which can
    # be one ulp off the correctly rounded amax / 448
    scale = amax / torch.full_like(amax, FP8_MAX)
    if ue8m0:
        scale = _power_of_two_ceil(scale)
    codes = torch.clamp(groups / scale, -FP8_MAX, FP8_MAX)
    codes = torch.where(finite, codes, 0.0).to(torch.float8_e4m3fn)
    codes = torch.where(codes.float() == 0, torch.zeros_like(codes), codes)
    return codes, torch.where(finite, scale, torch.nan)


def act_quant(x: torch.Tensor, scale_fmt: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token per 128 columns: ``amax = max(max|x|, 1e-4)``, ``s = amax / 448`` (``"ue8m0"``:
    ``2 ** ceil(log2(amax / 448))``), ``q = e4m3(clamp(x / s, -448, 448))``, a zero code +0; a group
    with a NaN or an infinity gets ``s = NaN`` and ``q = 0``. ``x [M, K]`` -> (e4m3 ``[M, K]``, fp32 ``[M, K / 128]``)."""
    m, k = x.shape
    groups = x.float().reshape(m, k // GROUP, GROUP)
    amax = groups.abs().amax(dim=-1, keepdim=True)   # NaN if the group has a NaN
    codes, scale = _quantize_groups(groups, amax, scale_fmt == "ue8m0")
    return codes.reshape(m, k), scale.reshape(m, k // GROUP)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 128 x 128 block of ``weight [N, K]`` (a partial last row block: its rows only), fp32
    scales ``max(amax, 1e-4) / 448``, a zero code +0: (e4m3 ``[N, K]``, fp32 ``[ceil(N / 128), K / 128]``)."""
    n, k = weight.shape
    w = weight.float()
    codes = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=w.device)
    scales = torch.empty(-(-n // GROUP), k // GROUP, dtype=torch.float32, device=w.device)
    for i, r in enumerate(range(0, n, GROUP)):
        for j, c in enumerate(range(0, k, GROUP)):
            block = w[r:r + GROUP, c:c + GROUP]
            q, s = _quantize_groups(block, block.abs().amax(), False)
            codes[r:r + GROUP, c:c + GROUP] = q
            scales[i, j] = s
    return codes, scales


def dequantize(codes: torch.Tensor, scale: torch.Tensor, rows_per_scale: int) -> torch.Tensor:
    """fp64 ``codes[i, j] * scale[i // rows_per_scale, j // 128]`` (weights: ``rows_per_scale``
    128; activations: 1)."""
    n, k = codes.shape
    row_index = torch.arange(n, device=codes.device) // rows_per_scale
    col_index = torch.arange(k, device=codes.device) // GROUP
    return codes.double() * scale.double()[row_index][:, col_index]


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``dequantize(a, a_scale) @ dequantize(w, w_scale)^T`` in fp64, rounded once to ``out_dtype``."""
    return (dequantize(a, a_scale, 1) @ dequantize(w, w_scale, GROUP).T).to(out_dtype)
