"""Reference lightning-indexer logits: dense torch over each row's live tokens, fp32 math."""

from __future__ import annotations

import torch


def reference_indexer_logits(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                             page_table_1: torch.Tensor,
                             seqlens: torch.Tensor) -> list[torch.Tensor]:
    """Per row ``r`` an fp32 ``[seqlens[r]]`` tensor:
    ``sum_h weights[r, h] * relu(q[r, h] . k_cache[page_table_1[r, t]])`` for ``t < seqlens[r]``."""
    logits = []
    for row, length in enumerate(seqlens.tolist()):
        length = max(length, 0)
        keys = k_cache[page_table_1[row, :length].long()].float()  # [length, 128]
        scores = torch.relu(q[row].float() @ keys.T)  # [H, length]
        logits.append((weights[row].float()[:, None] * scores).sum(0))
    return logits


def random_indexer_inputs(seqlens: list[int], num_heads: int, width: int, num_slots: int,
                          device, seed: int = 0, poison: int = 2**30) -> dict:
    """Random inputs for ``indexer_logits``: bf16 queries and keys, fp32 weights (scale folded
    in), a page table whose live prefixes hold random (repeating) slots and whose tails hold
    ``poison`` (an out-of-range slot id that must never be read)."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(seqlens)
    page_table = torch.full((rows, width), poison, dtype=torch.int32)
    for row, length in enumerate(seqlens):
        page_table[row, :length] = torch.randint(0, num_slots, (length,), generator=gen,
                                                 dtype=torch.int32)
    return dict(
        q=torch.randn(rows, num_heads, 128, generator=gen).to(torch.bfloat16).to(device),
        weights=(torch.randn(rows, num_heads, generator=gen)
                 * (128 * num_heads) ** -0.5).to(device),
        k_cache=torch.randn(num_slots, 128, generator=gen).to(torch.bfloat16).to(device),
        page_table_1=page_table.to(device),
        seqlens=torch.tensor(seqlens, dtype=torch.int32, device=device),
    )
