"""Reference sparse MQA attention over selected slots: gather, softmax and weighted sum in fp32."""

from __future__ import annotations

import torch


def reference_sparse_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                                sm_scale: float) -> torch.Tensor:
    """fp32 ``[R, H, 512]``: per row the softmax over valid slots (``>= 0``) of
    ``sm_scale * q[r, h] . kv_cache[slot]`` applied to ``kv_cache[slot, :512]``; zeros for a row
    without a valid slot."""
    num_rows, num_heads, _ = q.shape
    out = torch.zeros(num_rows, num_heads, 512, device=q.device)
    for row in range(num_rows):
        chosen = slots[row][slots[row] >= 0].long()
        if chosen.numel() == 0:
            continue
        keys = kv_cache[chosen].float()  # [n, 576]
        probs = torch.softmax(sm_scale * (q[row].float() @ keys.T), dim=-1)  # [H, n]
        out[row] = probs @ keys[:, :512]
    return out
