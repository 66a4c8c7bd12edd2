"""Pure PyTorch definitions of three fused MLA/indexer kernels: the latent epilogue
(``dsaspec.ops.mla_latent``: ``kv_a_layernorm`` and RoPE of a ``kv_a`` row, each rounded to the
input's dtype), the absorbed query (the same module: ``q_nope @ W_UK`` and the RoPE'd ``q_rope``)
and the indexer's head weights (``dsaspec.ops.index_weights``: fp32 ``weights_proj`` and its
scale)."""

from __future__ import annotations

import torch


def reference_mla_latent(kv, weight, eps: float, cos, sin, interleaved: bool) -> torch.Tensor:
    """``kv`` ``[R, 576]`` -> ``[R, 576]`` in ``kv``'s dtype: the first 512 values RMS-normed
    (``x * rsqrt(mean(x^2) + eps) * weight``, fp32), the last 64 rotated by ``cos``/``sin``
    ``[R, 32]`` (pairs ``(2i, 2i+1)`` when ``interleaved``, else ``(i, i + 32)``)."""
    x = kv[:, :512].float()
    latent = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight.float()
    k = kv[:, 512:].float()
    if interleaved:
        a, b = k[:, 0::2], k[:, 1::2]
    else:
        a, b = k[:, :32], k[:, 32:]
    first, second = a * cos - b * sin, a * sin + b * cos
    if interleaved:
        k_rope = torch.stack((first, second), dim=-1).reshape(k.shape)
    else:
        k_rope = torch.cat((first, second), dim=-1)
    return torch.cat((latent.to(kv.dtype), k_rope.to(kv.dtype)), dim=-1)


def reference_mla_query(q, w_uk, cos, sin, interleaved: bool) -> torch.Tensor:
    """``q`` ``[R, H, D + 64]``, ``w_uk`` ``[H, D, 512]`` -> ``[R, H, 576]`` in ``q``'s dtype: each
    head's ``q[..., :D] @ w_uk[h]`` summed in float64 and rounded to the dtype once, then
    ``q[..., D:]`` rotated by its row's ``cos``/``sin`` ``[R, 32]`` in fp32 (pairs ``(2i, 2i+1)``
    when ``interleaved``, else ``(i, i + 32)``)."""
    nope = q.shape[-1] - 64
    absorbed = torch.einsum("rhd,hdn->rhn", q[..., :nope].double(), w_uk.double())
    k = q[..., nope:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    if interleaved:
        a, b = k[..., 0::2], k[..., 1::2]
    else:
        a, b = k[..., :32], k[..., 32:]
    first, second = a * c - b * s, a * s + b * c
    rotated = torch.empty_like(k)
    if interleaved:
        rotated[..., 0::2], rotated[..., 1::2] = first, second
    else:
        rotated[..., :32], rotated[..., 32:] = first, second
    return torch.cat((absorbed.to(q.dtype), rotated.to(q.dtype)), dim=-1)


def reference_index_weights(x, weight, scale: float) -> torch.Tensor:
    """``x`` ``[R, K]``, ``weight`` ``[N, K]`` -> fp32 ``[R, N]``: ``x @ weight.T`` summed in
    float64 from the fp32 values, rounded to fp32, times ``scale`` (fp32)."""
    exact = (x.double() @ weight.float().double().T).float()
    return exact * torch.tensor(scale, dtype=torch.float32)
