"""Reference top-k over ragged lengths: a stable sort on the same order-preserving key."""

from __future__ import annotations

import torch


def float_order_key(values: torch.Tensor) -> torch.Tensor:
    """int64 keys (0 .. 2^32-1) ordered like the fp32 bit patterns of ``values``: for finite
    values the float order, with -0.0 below +0.0; NaNs land by sign beyond the infinities."""
    bits = values.float().contiguous().view(torch.int32).long()
    return torch.where(bits < 0, (~bits) & 0xFFFFFFFF, bits | 0x80000000)


def reference_topk_positions(logits: torch.Tensor, seqlens: torch.Tensor,
                             k: int) -> torch.Tensor:
    """int64 ``[R, k]``: per row the ``min(seqlens[r], k)`` positions ``t < seqlens[r]`` of the
    largest logits (ties to the lowest position), ascending, then ``-1``."""
    out = torch.full((logits.shape[0], k), -1, dtype=torch.int64, device=logits.device)
    for row, length in enumerate(seqlens.tolist()):
        length = max(length, 0)
        keys = float_order_key(logits[row, :length])
        chosen = torch.sort(keys, descending=True, stable=True).indices[:k]
        out[row, :chosen.numel()] = torch.sort(chosen).values
    return out


def reference_topk_slots(logits: torch.Tensor, seqlens: torch.Tensor, page_table_1: torch.Tensor,
                         k: int) -> torch.Tensor:
    """int32 ``[R, k]``: ``page_table_1[r, t]`` for the positions of
    :func:`reference_topk_positions`, ``-1`` where there is none."""
    positions = reference_topk_positions(logits, seqlens, k).to(page_table_1.device)
    slots = torch.gather(page_table_1.long(), 1, positions.clamp(min=0))
    return torch.where(positions >= 0, slots, -1).to(torch.int32)
