"""Plain-torch stand-ins for the DSA decode ops, with the ops' signatures (used until
dsaspec/reference/{indexer,topk,sparse_mla}.py land; CPU/eager only: they read lengths on the host).
"""

from __future__ import annotations

import torch


def indexer_logits(q_idx, weights, k_cache, page_table_1, seqlens, schedule, out):
    """``out[r, j] = sum_h weights[r, h] * relu(q_idx[r, h] . k_cache[page_table_1[r, j]])`` for
    ``j < seqlens[r]``, ``-inf`` beyond; fp32 math. Writes ``out`` fp32 ``[R, W_out]``."""
    rows, width = out.shape
    live = int(seqlens.max().clamp(min=0)) if rows else 0
    out.fill_(float("-inf"))
    if live == 0:
        return out
    keys = k_cache[page_table_1[:, :live].long()].float()                     # [R, live, D]
    dots = torch.einsum("rhd,rjd->rhj", q_idx.float(), keys).clamp_(min=0)
    scores = torch.einsum("rh,rhj->rj", weights.float(), dots)
    valid = torch.arange(live, device=out.device)[None, :] < seqlens[:, None]
    out[:, :live] = torch.where(valid, scores, torch.full_like(scores, float("-inf")))
    return out


def topk_slots(logits, seqlens, page_table_1, k, out):
    """Per row the ``k`` largest of ``logits[r, :seqlens[r]]`` (ties: lowest position; every
    position when ``seqlens[r] <= k``), positions ascending, mapped to slots through
    ``page_table_1``; ``-1`` fills. Writes ``out`` int32 ``[R, k]``."""
    out.fill_(-1)
    for r in range(out.shape[0]):
        n = int(seqlens[r])
        if n <= 0:
            continue
        if n <= k:
            positions = torch.arange(n, device=out.device)
        else:
            order = torch.sort(logits[r, :n], descending=True, stable=True).indices
            positions = order[:k].sort().values
        out[r, : positions.numel()] = page_table_1[r, positions].to(torch.int32)
    return out


def sparse_mla_decode(q, kv_cache, slots, sm_scale, out):
    """``out[r, h] = softmax_s(q[r, h] . kv[s] * sm_scale) @ kv[s, :512]`` over the slots
    ``s = slots[r, i] >= 0``; zeros for a row without slots; fp32 math. Writes ``out`` ``[R, H, 512]``."""
    value_dim = out.shape[-1]
    valid = slots >= 0                                                         # [R, k]
    kv = kv_cache[slots.clamp(min=0).long()].float()                          # [R, k, 576]
    scores = torch.einsum("rhd,rkd->rhk", q.float(), kv) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out.copy_(torch.einsum("rhk,rkd->rhd", probs, kv[..., :value_dim]))
    return out
