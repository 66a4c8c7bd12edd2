"""The routed experts a model's MoE layers read in a forward, counted from the router's ids: what
the bytes floor of a MoE layer charges for its expert weights (``FloorModel(experts_hit=...)``)."""

from __future__ import annotations

from collections import defaultdict

import torch


class ExpertsHitCounter:
    """While entered, a forward pre-hook on each of ``model``'s routed experts records every MoE
    call's rows (``topk_ids.shape[0]``, padding rows included: the fused MoE runs them too) and the
    distinct routed experts its ids name (ids ``< n_routed_experts``: the fused MoE's shared-expert
    slots are left out). Eager forwards only: a graph replay runs no hooks, and counting syncs."""

    def __init__(self, model):
        self.model = model
        self.calls: list[tuple[int, int]] = []          # (rows, distinct routed experts) per call
        self._hooks = []

    def __enter__(self) -> "ExpertsHitCounter":
        routed = self.model.config.n_routed_experts

        def count(module, args):
            ids = args[1]
            self.calls.append((ids.shape[0], int(torch.unique(ids[ids < routed]).numel())))

        self._hooks = [experts.register_forward_pre_hook(count) for experts in self.model.routed_experts().values()]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def by_rows(self) -> dict[int, float]:
        """Rows of a call -> the mean distinct routed experts over the calls of that many rows."""
        hits = defaultdict(list)
        for rows, distinct in self.calls:
            hits[rows].append(distinct)
        return {rows: sum(d) / len(d) for rows, d in sorted(hits.items())}
