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


def _hadamard(n: int) -> torch.Tensor:
    """Sylvester's ``n x n`` Hadamard matrix times ``n ** -0.5``, fp32: ``H[i, j] = (-1) ** popcount(i & j)``."""
    i = torch.arange(n)
    parity = torch.zeros(n, n, dtype=torch.int64)
    bits = i[:, None] & i[None, :]
    while bits.any():
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).float() * n ** -0.5


def reference_index_q_rope(q, cos, sin, rope_dim: int, interleaved: bool, rotate: bool) -> torch.Tensor:
    """``q`` ``[R, H, 128]`` -> RoPE'd (then rotated) query, ``q``'s dtype."""
    y = _rope(q.float(), cos.float(), sin.float(), rope_dim, interleaved).to(q.dtype)
    if rotate:
        y = (y.float() @ _hadamard(q.shape[-1]).to(q.device)).to(q.dtype)
    return y


def reference_index_k(k, weight, bias, eps: float, cos, sin, rope_dim: int, interleaved: bool,
                      rotate: bool) -> torch.Tensor:
    """``k`` ``[R, 128]`` -> LayerNorm'd, RoPE'd (then rotated) key, ``k``'s dtype."""
    y = F.layer_norm(k.float(), (k.shape[-1],), weight.float(), bias.float(), eps).to(k.dtype)
    return reference_index_q_rope(y[:, None], cos, sin, rope_dim, interleaved, rotate)[:, 0]
