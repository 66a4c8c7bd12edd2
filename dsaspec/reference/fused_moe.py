"""Pure PyTorch definition of the fused MoE (``dsaspec.ops.fused_moe``): a loop over tokens and
their experts in fp64, with the op's one intermediate rounding (the activation, to the hidden
dtype) and the output rounded once. The op accumulates in fp32, so the two agree within a
tolerance."""

from __future__ import annotations

import torch


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(gate) * up)`` with ``gate, up =
    w13[e, :I] @ x, w13[e, I:] @ x``, ``x = hidden[t]``, ``e = topk_ids[t, j]``; ``hidden [T, H]``,
    ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, ``topk_ids``/``topk_weights [T, k]`` -> ``[T, H]`` in
    hidden's dtype. ``silu(gate) * up`` is rounded to hidden's dtype before the down projection."""
    inter = w13.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float64, device=hidden.device)
    for t, row in enumerate(topk_ids.tolist()):
        x = hidden[t].double()
        for j, e in enumerate(row):
            gate = w13[e, :inter].double() @ x
            up = w13[e, inter:].double() @ x
            act = (gate * torch.sigmoid(gate) * up).to(hidden.dtype).double()
            out[t] += topk_weights[t, j].double() * (w2[e].double() @ act)
    return out.to(hidden.dtype)
