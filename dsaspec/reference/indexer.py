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
