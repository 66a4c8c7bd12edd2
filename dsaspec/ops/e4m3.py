"""Triton device functions of the e4m3 block quantization shared by the FP8 kernels (the
activation quantizer of :mod:`dsaspec.ops.fp8_gemm` and the FP8 KV cache writes of
:mod:`dsaspec.ops.fp8_kv`).

Rule (DeepSeek-V3.2's ``act_quant``, the module docstring of :mod:`dsaspec.ops.fp8_gemm`), per
row of a ``[M, G]`` block of fp32 values:

    amax = max(max |x[m, :]|, 1e-4)
    s    = amax / 448                              fp32 scales (correctly rounded)
    s    = 2 ** ceil(log2(amax / 448))             ue8m0 scales: the exponent of amax / 448,
                                                   plus one unless its mantissa is zero
    q    = e4m3_rne(clamp(x / s, -448, 448))       a zero code is +0

A row holding a NaN or an infinity gets ``s = NaN`` and ``q = 0``. ``x / s`` is rounded to the
e4m3 grid here (round to nearest even, by adding and subtracting ``1.5 * 2**23`` ulps in fp32), so
the final cast is exact: the codes are the same on the GPU and under the Triton interpreter, whose
own fp32 -> e4m3 cast can round across a binade.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_e4m3(y):
    """``y`` (fp32, |y| <= 448) rounded to the nearest e4m3 value, ties to even (a zero is +0): the
    ulp is ``2 ** (max(exponent, -6) - 3)`` (e4m3 subnormals below 2**-6)."""
    bits = y.to(tl.int32, bitcast=True)
    ulp_exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3
    magic = (((ulp_exp + 23 + 127) << 23) | (1 << 22)).to(tl.float32, bitcast=True)  # 1.5 * 2**23 ulps
    rounded = (tl.abs(y) + magic) - magic
    return tl.where(rounded == 0.0, 0.0, tl.where(y < 0, -rounded, rounded))


@triton.jit
def quantize_rows(x, UE8M0: tl.constexpr, ROUND: tl.constexpr = True):
    """Quantize each row of ``x`` (fp32 ``[M, G]``) with one scale (module docstring): returns the
    codes as fp32 values on the e4m3 grid ``[M, G]`` and the scales fp32 ``[M]``. ``ROUND=False``
    leaves ``x / s`` clamped but not rounded, for a caller whose GPU cast to e4m3 rounds it (to
    nearest even: the same codes, but a negative value that rounds to zero gives -0, not +0)."""
    ax = tl.abs(x)
    # max() drops NaNs on the GPU: count them apart
    bad = (tl.max((x != x).to(tl.int32), axis=1) > 0) | (tl.max(ax, axis=1) == float("inf"))
    amax = tl.maximum(tl.max(tl.where(x == x, ax, 0.0), axis=1), 1e-4)
    s = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    if UE8M0:
        bits = s.to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        s = (exponent << 23).to(tl.float32, bitcast=True)
        # x / 2**p is x * 2**-p, both the correctly rounded same real (2**-p exact: p in [-22, 119]
        # for amax in [1e-4, fp32 max]); a multiply instead of an IEEE division a value
        inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)
        y = x * tl.broadcast_to(inverse[:, None], x.shape)
    else:
        y = tl.math.div_rn(x, tl.broadcast_to(s[:, None], x.shape))
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if ROUND:
        y = round_to_e4m3(y)
    y = tl.where(bad[:, None], 0.0, y)
    s = tl.where(bad, float("nan"), s)
    return y, s
