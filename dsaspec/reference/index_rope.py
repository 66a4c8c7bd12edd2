"""Pure PyTorch definitions of the indexer's query and key epilogues (``dsaspec.ops.index_rope``):
LayerNorm (keys), RoPE on the first ``rope_dim`` values, the Hadamard rotation (FP8 caches), each
step rounded to the input's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int, interleaved: bool) -> torch.Tensor:
    """``x`` fp32 ``[R, H, 128]``, ``cos``/``sin`` ``[R, rope_dim / 2]``."""
    out = x.clone()
    if interleaved:
        first, second = list(range(0, rope_dim, 2)), list(range(1, rope_dim, 2))
    else:
        first, second = list(range(rope_dim // 2)), list(range(rope_dim // 2, rope_dim))
    a, b = x[..., first], x[..., second]
    c, s = cos[:, None, :], sin[:, None, :]
    out[..., first] = a * c - b * s
    out[..., second] = a * s + b * c
    return out


def _rotate(y: torch.Tensor) -> torch.Tensor:
    """``y @ H * n ** -0.5`` per row of fp32 ``y`` ``[..., n]``, ``H`` Sylvester's +-1 Hadamard
    matrix (``H[i, j] = (-1) ** popcount(i & j)``), by the fast Walsh-Hadamard transform: for bit
    0, 1, ..., log2(n) - 1 in turn, the values at ``j`` (that bit clear) and ``j + 2 ** bit``
    become their fp32 sum and difference; then one fp32 multiply by ``n ** -0.5``."""
    n, half = y.shape[-1], 1
    while half < n:
        pairs = y.reshape(*y.shape[:-1], n // (2 * half), 2, half)
        low, high = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((low + high, low - high), dim=-2).reshape(y.shape)
        half *= 2
    return y * torch.tensor(n ** -0.5, dtype=torch.float32)


def reference_index_q_rope(q, cos, sin, rope_dim: int, interleaved: bool, rotate: bool) -> torch.Tensor:
    """``q`` ``[R, H, 128]`` -> RoPE'd (then rotated) query, ``q``'s dtype."""
    y = _rope(q.float(), cos.float(), sin.float(), rope_dim, interleaved).to(q.dtype)
    if rotate:
        y = _rotate(y.float()).to(q.dtype)
    return y


def reference_index_k(k, weight, bias, eps: float, cos, sin, rope_dim: int, interleaved: bool,
                      rotate: bool) -> torch.Tensor:
    """``k`` ``[R, 128]`` -> LayerNorm'd, RoPE'd (then rotated) key, ``k``'s dtype."""
    y = F.layer_norm(k.float(), (k.shape[-1],), weight.float(), bias.float(), eps).to(k.dtype)
    return reference_index_q_rope(y[:, None], cos, sin, rope_dim, interleaved, rotate)[:, 0]
