"""RoPE's cos/sin tables of one forward in one kernel (Triton), bit for bit the torch ops of
:class:`dsaspec.layers.rotary.Rotary` (an fp64 multiply, cos, sin, the factor, two fp32 casts:
five launches):

    angle  = float64(position[r]) * inv_freq[i]                  (one fp64 multiply, rounded)
    cos[r, i] = float32(cos64(angle) * factor),  sin[r, i] = float32(sin64(angle) * factor)

with ``cos64`` / ``sin64`` the fp64 ``tl.cos`` / ``tl.sin``, which Triton lowers to libdevice's
``__nv_cos`` / ``__nv_sin`` on CUDA (the PTX is that of the explicit libdevice call), the CUDA
math library functions torch's fp64 ``cos`` / ``sin`` run there; under the Triton interpreter
they are numpy's. The factor multiply is fp64 (``factor`` passed by its 64 bits: a Python float
argument would reach the kernel as fp32) and exact when it is 1; both casts round to nearest
even. A program owns up to 32 whole rows (fewer rows, fewer a program: at one row a program of one
warp computes that row's values alone, not 32 rows' of which 31 are masked); a row's bits never
depend on the other rows.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from dsaspec.ops.checks import check_tensor

_ROWS = 32   # the most rows a program owns
_POSITION_DTYPES = (torch.int32, torch.int64)


@triton.jit(do_not_specialize=["R", "factor_bits"])
def _rope_cos_sin_kernel(pos_ptr, inv_freq_ptr, cos_ptr, sin_ptr, R, stride_pos, factor_bits, HALF: tl.constexpr,
                         BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < R
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < HALF
    position = tl.load(pos_ptr + rows.to(tl.int64) * stride_pos, mask=live, other=0).to(tl.float64)
    inv_freq = tl.load(inv_freq_ptr + cols, mask=col_ok, other=0.0)
    angle = position[:, None] * inv_freq[None, :]
    factor = factor_bits.to(tl.int64).to(tl.float64, bitcast=True)
    offsets = rows.to(tl.int64)[:, None] * HALF + cols[None, :]
    mask = live[:, None] & col_ok[None, :]
    tl.store(cos_ptr + offsets, (tl.cos(angle) * factor).to(tl.float32), mask=mask)
    tl.store(sin_ptr + offsets, (tl.sin(angle) * factor).to(tl.float32), mask=mask)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions`` int32 / int64 ``[R]`` (any stride), ``inv_freq`` fp64 ``[d/2]`` on the same
    device, ``factor`` a float -> ``(cos, sin)``, new fp32 tensors ``[R, d/2]``:
    ``float32(cos(float64(position) * inv_freq) * factor)`` and the same with ``sin``, the fp64
    steps of the module docstring."""
    check_tensor("positions", positions, dtype=_POSITION_DTYPES, ndim=1, contiguous_last=False)
    check_tensor("inv_freq", inv_freq, dtype=torch.float64, ndim=1, device=positions.device)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise TypeError(f"factor: expected a float, got {type(factor).__name__}")
    rows, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty(rows, half, dtype=torch.float32, device=positions.device)
    sin = torch.empty(rows, half, dtype=torch.float32, device=positions.device)
    if rows and half:
        factor_bits = struct.unpack("<q", struct.pack("<d", float(factor)))[0]
        per_program = min(_ROWS, triton.next_power_of_2(rows))
        _rope_cos_sin_kernel[(triton.cdiv(rows, per_program),)](
            positions, inv_freq, cos, sin, rows, positions.stride(0), factor_bits, HALF=half,
            BLOCK_D=triton.next_power_of_2(half), ROWS=per_program, num_warps=min(4, per_program))
    return cos, sin
