"""Pure PyTorch definitions of the MoE router (``dsaspec.ops.moe_router``): the logits in float64,
and the selection as a loop over tokens on the host, fp32 values, sorting with explicit tie rules
(the larger value first, then the lower index), the weights summed one after another in selection
order."""

from __future__ import annotations

from typing import Callable

import torch


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [T, K] @ weight [E, K]^T`` in float64 on the host (``[T, E]`` float64): the fp32 kernel's
    target, within its fp32 rounding."""
    return x.cpu().double() @ weight.cpu().double().T


def route_topk(logits: torch.Tensor, bias: torch.Tensor, *, top_k: int, n_group: int, topk_group: int,
               norm_topk_prob: bool, scaling: float, n_shared: int = 0,
               exp: Callable[[torch.Tensor], torch.Tensor] = torch.exp) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids int32 [T, k], weights fp32 [T, k])`` from fp32 ``logits [T, E]`` and ``bias [E]``:
    scores ``1 / (1 + exp(-l))``, group scores the sum of each group's two largest ``scores + bias``,
    the ``topk_group`` best groups, then the ``top_k`` largest ``scores + bias`` among their experts;
    weights the selected scores, divided by their sum (in selection order) + 1e-20 when
    ``norm_topk_prob``, times ``scaling``; then ``n_shared`` more slots per token, the shared
    experts ``E, E + 1, ...`` with weight 1 (``[T, k + n_shared]`` in all). ``exp``: fp32 tensor ->
    fp32 tensor (numpy's for the interpreter, torch's on the GPU)."""
    tokens, experts = logits.shape
    group = experts // n_group
    ids = torch.empty(tokens, top_k + n_shared, dtype=torch.int32)
    weights = torch.empty(tokens, top_k + n_shared, dtype=torch.float32)
    one = torch.tensor(1.0, dtype=torch.float32)
    for t in range(tokens):
        scores = (one / (one + exp(-logits[t].float()))).cpu()
        choice = (scores + bias.float().cpu()).tolist()
        group_scores = []
        for g in range(n_group):
            top = sorted(choice[g * group:(g + 1) * group], reverse=True)
            group_scores.append(torch.tensor(top[0], dtype=torch.float32) + torch.tensor(top[1], dtype=torch.float32))
        best = sorted(range(n_group), key=lambda g: (-float(group_scores[g]), g))[:topk_group]
        candidates = [e for e in range(experts) if e // group in best]
        picked = sorted(candidates, key=lambda e: (-choice[e], e))[:top_k]
        w = scores[picked]
        if norm_topk_prob:
            total = torch.tensor(0.0, dtype=torch.float32)
            for value in w:
                total = total + value
            w = w / (total + torch.tensor(1e-20, dtype=torch.float32))
        ids[t] = torch.tensor(picked + [experts + s for s in range(n_shared)], dtype=torch.int32)
        weights[t] = torch.cat([w * torch.tensor(scaling, dtype=torch.float32), torch.ones(n_shared)])
    return ids.to(logits.device), weights.to(logits.device)
