"""RMSNorm and LayerNorm in fp32 math, row-invariant on request.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsaspec.layers.fp8_linear import ActQuant, Fp8Input
from dsaspec.layers.row_invariant import RowInvariant, row_invariant_ops
from dsaspec.ops.fp8_gemm import BLOCK


class RMSNorm(RowInvariant, nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight`` in fp32, returned in ``x``'s dtype: the Triton
    kernel of :mod:`dsaspec.ops.row_invariant` when ``row_invariant`` or ``use_triton`` (set by
    :class:`DSAModel`), else plain torch.

    With ``residual``, the norm of ``s = x + residual`` and ``s`` itself: ``(y, s)``, one kernel
    (:func:`~dsaspec.ops.row_invariant.add_rms_norm`, bitwise the add then the norm) or the torch add
    then the torch norm.

    ``quant``: the :class:`~dsaspec.layers.fp8_linear.ActQuant` of the FP8 GEMMs that read ``y``.
    With ``use_triton`` the kernel then also writes ``y``'s e4m3 codes ``[M, D]`` and fp32 scales
    ``[M, D / 128]`` (act_quant's, of ``y`` as stored; ``D`` a multiple of 128), and ``y`` comes
    back as an :class:`~dsaspec.layers.fp8_linear.Fp8Input` holding the three (each allocated per
    call); otherwise ``quant`` changes nothing and the GEMMs quantize ``y`` themselves."""

    use_triton: bool = False

    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, quant: ActQuant | None = None):
        kernel = self.row_invariant or self.use_triton
        if residual is not None:
            if kernel:
                return self._kernel(x, residual, quant)
            x = x + residual
            return self.forward(x), x
        if kernel:
            return self._kernel(x, None, quant)
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)

    def _kernel(self, x, residual, quant):
        """The Triton kernel: ``y``, or ``(y, s)`` with ``residual``; ``y`` an ``Fp8Input`` where
        ``quant`` applies."""
        ops = row_invariant_ops()
        fp8 = {}
        if quant is not None and self.use_triton:
            rows, dim = x.shape
            fp8 = dict(q_out=torch.empty(rows, dim, dtype=torch.float8_e4m3fn, device=x.device),
                       scale_out=torch.empty(rows, dim // BLOCK, dtype=torch.float32, device=x.device),
                       scale_fmt=quant.scale_fmt)
        if residual is None:
            y, s = ops.rms_norm(x, self.weight, self.eps, **fp8), None
        else:
            y, s = ops.add_rms_norm(x, residual, self.weight, self.eps, **fp8)
        if fp8:
            y = Fp8Input(y, fp8["q_out"], fp8["scale_out"], quant.scale_fmt)
        return y if residual is None else (y, s)


class LayerNorm(RowInvariant, nn.Module):
    """LayerNorm with weight and bias (the indexer's ``k_norm``), fp32 math."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_invariant:
            return row_invariant_ops().layer_norm(x, self.weight, self.bias, self.eps)
        y = F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)
