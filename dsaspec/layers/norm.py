"""RMSNorm and LayerNorm in fp32 math, row-invariant on request.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsaspec.layers.row_invariant import RowInvariant, row_invariant_ops


class RMSNorm(RowInvariant, nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight`` in fp32, returned in ``x``'s dtype: the Triton
    kernel of :mod:`dsaspec.ops.row_invariant` when ``row_invariant`` or ``use_triton`` (set by
    :class:`DSAModel`), else plain torch.

    With ``residual``, the norm of ``s = x + residual`` and ``s`` itself: ``(y, s)``, one kernel
    (:func:`~dsaspec.ops.row_invariant.add_rms_norm`, bitwise the add then the norm) or the torch add
    then the torch norm."""

    use_triton: bool = False

    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        kernel = self.row_invariant or self.use_triton
        if residual is not None:
            if kernel:
                return row_invariant_ops().add_rms_norm(x, residual, self.weight, self.eps)
            x = x + residual
            return self.forward(x), x
        if kernel:
            return row_invariant_ops().rms_norm(x, self.weight, self.eps)
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


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
