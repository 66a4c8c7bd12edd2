"""RoPE with YaRN scaling: inverse frequencies, cos/sin per position, and the rotation.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dsaspec.configs.model_config import ModelConfig, yarn_mscale


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies fp64 ``[qk_rope_head_dim // 2]`` and the cos/sin factor
    (YaRN's ``mscale(mscale) / mscale(mscale_all_dim)``, 1 without scaling)."""
    dim = config.qk_rope_head_dim
    base = config.rope_theta
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast", 32.0))
    beta_slow = float(scaling.get("beta_slow", 1.0))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)
    extrapolate = 1.0 - ramp.clamp(0.0, 1.0)  # 1: keep the original (high) frequency
    inv_freq = inv_freq / factor * (1.0 - extrapolate) + inv_freq * extrapolate
    cos_sin_factor = (yarn_mscale(factor, float(scaling.get("mscale", 1.0) or 0.0))
                      / yarn_mscale(factor, float(scaling.get("mscale_all_dim", 0.0) or 0.0)))
    return inv_freq, cos_sin_factor


class Rotary(nn.Module):
    """cos/sin of the RoPE angles ``position * inv_freq`` (angles in fp64, so large positions keep
    their precision): one Triton kernel when ``use_triton`` (set by :class:`DSAModel`;
    :func:`~dsaspec.ops.rope_cos_sin.rope_cos_sin`, the same fp64 steps), else five torch ops."""

    use_triton: bool = False

    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        inv_freq, self.cos_sin_factor = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` int ``[R]`` -> ``(cos, sin)`` fp32 ``[R, rope_dim // 2]``."""
        if self.use_triton:
            from dsaspec.ops.rope_cos_sin import rope_cos_sin

            return rope_cos_sin(positions, self.inv_freq, self.cos_sin_factor)
        # the multiply promotes the positions to fp64 itself; a factor of 1 is left out (exact)
        angles = positions[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        if self.cos_sin_factor != 1.0:
            cos, sin = cos * self.cos_sin_factor, sin * self.cos_sin_factor
        return cos.float(), sin.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the last dim of ``x`` ``[R, ..., d]`` by the angles of its row (``cos``/``sin``
    fp32 ``[R, d/2]``): pairs ``(2i, 2i+1)`` when ``interleaved``, else ``(i, i + d/2)``.
    fp32 math, result in ``x``'s dtype."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.to(x.dtype)


def apply_rope_first(x: torch.Tensor, rope_dim: int, cos, sin, interleaved: bool) -> torch.Tensor:
    """RoPE on the first ``rope_dim`` dims of the last axis (the indexer's layout)."""
    return torch.cat((apply_rope(x[..., :rope_dim], cos, sin, interleaved), x[..., rope_dim:]), dim=-1)
