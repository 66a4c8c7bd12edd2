"""Pure PyTorch definitions of the row-invariant ops (``dsaspec.ops.row_invariant``): fp64 math,
result rounded once to the input's dtype. The ops accumulate in fp32, so they match these within a
tolerance, not bitwise; row invariance itself is checked by comparing the ops with themselves."""

from __future__ import annotations

import torch


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T`` -> ``[M, N]`` in ``x``'s dtype."""
    return (x.double() @ weight.double().T).to(x.dtype)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [B, M, K] @ b [B, K, N]`` -> ``[B, M, N]`` in ``a``'s dtype."""
    return torch.bmm(a.double(), b.double()).to(a.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, in ``x``'s dtype."""
    xd = x.double()
    return (xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + eps) * weight.double()).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(s), s)`` with ``s = x + residual`` rounded to ``x``'s dtype."""
    s = (x.double() + residual.double()).to(x.dtype)
    return rms_norm(s, weight, eps), s


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x - mean) * rsqrt(var + eps) * weight + bias`` (biased variance) over the last dim, in
    ``x``'s dtype."""
    xd = x.double()
    centred = xd - xd.mean(-1, keepdim=True)
    rstd = torch.rsqrt(centred.square().mean(-1, keepdim=True) + eps)
    return (centred * rstd * weight.double() + bias.double()).to(x.dtype)
