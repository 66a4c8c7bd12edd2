"""Reference lightning-indexer logits: dense torch over each row's live tokens (bf16 keys, fp32
math; FP8 paged keys read from their bytes, fp64 math)."""

from __future__ import annotations

import torch

from dsaspec.reference.fp8_gemm import act_quant


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


def reference_indexer_logits_fp8(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                                 page_table_1: torch.Tensor,
                                 seqlens: torch.Tensor) -> list[torch.Tensor]:
    """DeepSeek-V3.2's ``fp8_index`` over a paged FP8 key cache (uint8 ``[pages, 8448]``: per
    page 64 x 128 e4m3 codes, then 64 fp32 scales), in fp64. Per row ``r`` an fp64
    ``[seqlens[r]]`` tensor: ``ks[s] * sum_h weights[r, h] * qs[h] * relu(qc[h] . kc[s])`` with
    ``qc, qs = act_quant(q[r], "ue8m0")`` (one scale per head) and ``s = page_table_1[r, t]``."""
    logits = []
    for row, length in enumerate(seqlens.tolist()):
        length = max(length, 0)
        q_codes, q_scales = act_quant(q[row].float(), "ue8m0")            # [H, 128], [H, 1]
        slots = page_table_1[row, :length].long()
        pages, offsets = (slots // 64)[:, None], (slots % 64)[:, None]
        code_bytes = k_cache[pages, 128 * offsets + torch.arange(128)]         # [length, 128]
        scale_bytes = k_cache[pages, 8192 + 4 * offsets + torch.arange(4)]     # [length, 4]
        k_codes = code_bytes.view(torch.float8_e4m3fn).double()
        k_scales = scale_bytes.view(torch.float32).double()[:, 0]
        head_weights = weights[row].double() * q_scales[:, 0].double()          # [H]
        scores = torch.relu(q_codes.double() @ k_codes.T)                      # [H, length]
        logits.append((head_weights[:, None] * scores).sum(0) * k_scales)
    return logits
