"""scripts/bench_fp8_linear.py's CUDA-core prototype: the block-scaled FP8 product of its two
launches within the fp32 sums' rounding of the exact one, at every row count it serves, ragged N
and several K groups."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_fp8_linear as bench  # noqa: E402

from dsaspec.ops import fp8_gemm as op  # noqa: E402

pytestmark = pytest.mark.interpreter


def _exact(codes, scales, w, w_s):
    """float64 ``sum_kb (codes[:, kb] @ w[:, kb]^T) * scales[:, kb] * w_s[n // 128, kb]`` and the
    sum of the absolute terms."""
    blocks = codes.shape[1] // op.BLOCK
    a = codes.double().view(codes.shape[0], blocks, op.BLOCK) * scales.double()[:, :, None]
    w_scale = w_s.double().repeat_interleave(op.BLOCK, dim=0)[: w.shape[0]]
    b = w.double().view(w.shape[0], blocks, op.BLOCK) * w_scale[:, :, None]
    a, b = a.flatten(1), b.flatten(1)
    return a @ b.T, a.abs() @ b.abs().T


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_cuda_core_linear_within_rounding(m, scale_fmt):
    gen = torch.Generator().manual_seed(m)
    n, k = 200, 1024
    w, w_s = op.quantize_weight(torch.randn(n, k, generator=gen) / k ** 0.5)
    x = (torch.randn(m, k, generator=gen) * 3).bfloat16()
    out = torch.full((m, n), 7.0, dtype=torch.bfloat16)
    bench.cuda_core_linear(x, w, w_s, scale_fmt, out, programs_per_sm=1)   # 132 SMs off-GPU: 4 K groups here
    codes, scales = op.act_quant(x, scale_fmt)
    exact, magnitude = _exact(codes, scales, w, w_s)
    bound = 2.0 ** -7 * exact.abs() + 2 * (k + 3) * 2.0 ** -24 * magnitude
    assert torch.all((out.double() - exact).abs() <= bound)
