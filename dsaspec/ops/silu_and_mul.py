"""The dense SwiGLU's activation in one kernel (Triton): ``silu(gate) * up`` over the gate/up GEMM's
output, bit for bit the two torch launches :class:`dsaspec.layers.mlp.MLP` runs without it
(``F.silu(gate) * up``). Per element, in fp32, with ``round`` to the tensors' dtype (nearest even;
the identity in fp32):

    s   = round(g / (1 + exp(-g)))        (torch's silu: fp32 math, one rounding to the dtype)
    out = round(s * u)                    (torch's multiply: fp32 product, rounded again)

``exp`` is the CUDA math library's ``expf`` on the GPU (libdevice ``__nv_expf``, what torch's
``::exp(float)`` compiles to; ``tl.exp`` would be ``ex2.approx``) and the division IEEE
(``div.rn.f32``, nvcc's default ``-prec-div``). The tensors are read and written as their bits, bf16
widened by a shift and rounded to nearest even on the bits (the interpreter's bf16 casts flush
denormals and truncate). Under the Triton interpreter, which cannot call libdevice, ``exp`` is
numpy's fp32 ``exp``; torch's CPU silu has its own vectorized ``exp``, and the two differ in the
last ulp of some values, so off the GPU the kernel equals the same formula over numpy's ``exp``
(every rounding after it is torch's).

The MoE kernel's activation (:mod:`dsaspec.ops.fused_moe`) is not this one: it sits in the gate/up
GEMM's epilogue and rounds once from the fp32 accumulators (``tl.exp``, no bf16 step between silu
and the multiply), the contract of its own reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dsaspec.ops.argmax_exchange import _widened_bits
from dsaspec.ops.checks import check_tensor
from dsaspec.ops.device import enter_chain, interpreted, supports_pdl
from dsaspec.ops.fp8_kv import _bf16_bits
from dsaspec.ops.index_rope import _round

_DTYPES = (torch.bfloat16, torch.float32)
_BLOCK_I = 1024   # features per program (one row a program)


@triton.jit
def torch_exp(x, LIBDEVICE_EXP: tl.constexpr):
    """fp32 ``exp(x)`` as torch's CUDA kernels compute it: libdevice's ``expf`` (``LIBDEVICE_EXP``,
    on the GPU), else ``tl.exp`` (the interpreter, which cannot call libdevice: numpy's ``exp``)."""
    if LIBDEVICE_EXP:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _silu_and_mul_kernel(gate_ptr, up_ptr, out_ptr, I, stride_gate, stride_up, stride_out, BF16: tl.constexpr,
                         LIBDEVICE_EXP: tl.constexpr, BLOCK_I: tl.constexpr, CHAINED: tl.constexpr):
    # the tensors' bits (int16 for bf16, int32 for fp32), widened and narrowed on the bits: the
    # interpreter's bf16 <-> fp32 casts mishandle denormals (and its narrowing truncates)
    enter_chain(CHAINED)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    live = cols < I
    g = _widened_bits(tl.load(gate_ptr + row * stride_gate + cols, mask=live, other=0), BF16)
    u = _widened_bits(tl.load(up_ptr + row * stride_up + cols, mask=live, other=0), BF16)
    g = g.to(tl.float32, bitcast=True)
    u = u.to(tl.float32, bitcast=True)
    e = torch_exp(-g, LIBDEVICE_EXP)
    y = _round(tl.math.div_rn(g, 1.0 + e), BF16) * u
    if BF16:
        y_bits = _bf16_bits(y)
    else:
        y_bits = y.to(tl.int32, bitcast=True)
    tl.store(out_ptr + row * stride_out + cols, y_bits, mask=live)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out = silu(gate) * up`` with torch's two roundings (module docstring), one launch.

    ``gate``, ``up``: ``[T, I]`` of one dtype (bf16 or fp32) on one device, the last dimension
    contiguous, any row stride (the two column halves of one ``[T, 2I]`` GEMM output, say).
    ``out``: ``[T, I]`` of that dtype, last dimension contiguous, not overlapping the inputs; None:
    a new contiguous tensor. Returns ``out``, every element written."""
    check_tensor("gate", gate, dtype=_DTYPES, ndim=2)
    check_tensor("up", up, dtype=gate.dtype, shape=tuple(gate.shape), device=gate.device)
    rows, width = gate.shape
    if out is None:
        out = torch.empty(rows, width, dtype=gate.dtype, device=gate.device)
    check_tensor("out", out, dtype=gate.dtype, shape=(rows, width), device=gate.device)
    if rows and width:
        bits = torch.int16 if gate.dtype == torch.bfloat16 else torch.int32
        chained = supports_pdl(gate.device)
        _silu_and_mul_kernel[(rows, triton.cdiv(width, _BLOCK_I))](
            gate.view(bits), up.view(bits), out.view(bits), width, gate.stride(0), up.stride(0), out.stride(0),
            BF16=bits == torch.int16, LIBDEVICE_EXP=not interpreted(_silu_and_mul_kernel), BLOCK_I=_BLOCK_I,
            CHAINED=chained, launch_pdl=chained)
    return out
