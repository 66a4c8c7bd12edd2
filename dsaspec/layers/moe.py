"""The mixture-of-experts FFN of GLM-5 / DeepSeek-V3.2: a sigmoid router with group-limited top-k
(``topk_method: noaux_tc``), ``n_routed_experts`` routed SwiGLU experts and the shared expert(s).

Tensor parallel: every expert is split by its intermediate features, like the dense FFN (the
gate/up rows of ``w13`` column parallel, ``w2`` row parallel); the router and the correction bias
are replicated. Every rank holds every token's hidden state after the attention's all-reduce, so
each rank runs the same routing and its share of every selected expert, and the partial outputs of
the routed and shared experts are summed by the layer's one all-reduce, as in the dense FFN: no
all-to-all, no token dispatch, and the group's collectives stay those the fake-TP emulation
(tests/fake_tp.py) checks. Each rank reads exactly ``1 / tp`` of every expert hit, whatever the
routing; expert parallelism (whole experts per rank) would add the all-to-all and leave the rank
holding the most hit experts of a small decode batch reading more than its share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsaspec.configs.model_config import ModelConfig
from dsaspec.distributed.tp_group import TPGroup
from dsaspec.layers.linear import Linear
from dsaspec.layers.mlp import MLP
from dsaspec.layers.row_invariant import RowInvariant, row_invariant_ops


@dataclass(frozen=True, eq=False)
class CheckpointPart:
    """One checkpoint tensor (or a slice of it) and the part of a fused parameter it fills:
    ``target.copy_(checkpoint[name][index])``, where ``name`` is relative to the module's prefix and
    ``full_shape`` is the checkpoint tensor's shape."""

    name: str
    full_shape: tuple[int, ...]
    index: tuple[slice, ...]
    target: torch.Tensor


class Router(Linear):
    """``mlp.gate``: fp32 ``weight`` ``[E, hidden]`` and ``e_score_correction_bias`` ``[E]``
    (replicated). ``forward(x)`` -> ``(topk_ids int32 [T, k], topk_weights fp32 [T, k])``:

        s = sigmoid(x @ weight.T)                            (fp32)
        c = s + e_score_correction_bias                      (selection only)
        group score = sum of the top 2 of c in each of n_group groups of E / n_group experts
        ids = top-k of c over the experts of the topk_group best groups
        w = s[ids] (/ sum(s[ids]) + 1e-20 if norm_topk_prob) * routed_scaling_factor

    Per token; no host sync, static shapes."""

    def __init__(self, config: ModelConfig, device=None):
        super().__init__(config.hidden_size, config.n_routed_experts, bias=False, device=device, dtype=torch.float32)
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(config.n_routed_experts, device=device, dtype=torch.float32))
        self.top_k, self.groups, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = super().forward(x.float()).sigmoid()
        tokens, experts = scores.shape
        choice = (scores + self.e_score_correction_bias).view(tokens, self.groups, experts // self.groups)
        best_groups = choice.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices
        in_best = torch.zeros(tokens, self.groups, 1, dtype=torch.bool, device=x.device)
        in_best.scatter_(1, best_groups[..., None], True)
        ids = choice.masked_fill(~in_best, float("-inf")).view(tokens, experts).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids.to(torch.int32), weights * self.scaling


class RoutedExperts(RowInvariant, nn.Module):
    """``mlp.experts``: ``w13`` ``[E, 2 I_r, hidden]`` (expert e's gate rows then up rows) and ``w2``
    ``[E, hidden, I_r]``, ``I_r = moe_intermediate_size / tp`` (this rank's intermediate features).

    ``forward(x [T, hidden], topk_ids int32 [T, k], topk_weights fp32 [T, k])`` -> ``[T, hidden]``
    in ``x``'s dtype, this rank's partial of ``sum_j w_j * down_j(silu(gate_j x) * up_j x)``:
    ``dsaspec.ops.fused_moe.fused_moe`` when ``use_fused`` (set by the model: the Triton ops with
    ``RuntimeOptions.fused_moe``, not row-invariant), else plain torch: a loop over all experts in a fixed order,
    each on every token, its output times the token's weight for it (0 when not selected) added in
    fp32. The torch path has static shapes and no host sync (CUDA-graph safe) and computes each
    token from its own row only, so with the row-invariant GEMM its result does not depend on the
    other tokens; it costs every expert's weights and FLOPs on every token (a fallback, not fast)."""

    use_fused: bool = False

    def __init__(self, config: ModelConfig, group: TPGroup, device=None, dtype=None):
        super().__init__()
        self.group = group
        self.num_experts, self.hidden = config.n_routed_experts, config.hidden_size
        self.full_intermediate = config.moe_intermediate_size
        self.intermediate = config.moe_intermediate_size // group.size
        shape13 = (self.num_experts, 2 * self.intermediate, self.hidden)
        self.w13 = nn.Parameter(torch.empty(shape13, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(self.num_experts, self.hidden, self.intermediate, device=device, dtype=dtype))

    def checkpoint_parts(self, fused: bool = False) -> dict[str, list[CheckpointPart]]:
        """Where ``w13`` / ``w2`` (the keys) come from in a checkpoint: per expert
        ``{e}.gate_proj.weight`` / ``{e}.up_proj.weight`` ``[I, hidden]`` and
        ``{e}.down_proj.weight`` ``[hidden, I]`` (the official checkpoints, transformers'
        ``save_pretrained``), or with ``fused`` transformers' in-memory ``gate_up_proj`` ``[E, 2I,
        hidden]`` and ``down_proj`` ``[E, hidden, I]``. A rank takes its intermediate slice
        ``[rank * I_r, (rank + 1) * I_r)`` of each."""
        full, local, hidden, experts = self.full_intermediate, self.intermediate, self.hidden, self.num_experts
        mine = slice(self.group.rank * local, (self.group.rank + 1) * local)
        up = slice(full + mine.start, full + mine.stop)
        gate_t, up_t, every = self.w13[:, :local], self.w13[:, local:], slice(None)
        if fused:
            return {"w13": [CheckpointPart("gate_up_proj", (experts, 2 * full, hidden), (every, mine, every), gate_t),
                            CheckpointPart("gate_up_proj", (experts, 2 * full, hidden), (every, up, every), up_t)],
                    "w2": [CheckpointPart("down_proj", (experts, hidden, full), (every, every, mine), self.w2)]}
        return {"w13": [CheckpointPart(f"{e}.{proj}.weight", (full, hidden), (mine, every), target[e])
                        for e in range(experts) for proj, target in (("gate_proj", gate_t), ("up_proj", up_t))],
                "w2": [CheckpointPart(f"{e}.down_proj.weight", (hidden, full), (every, mine), self.w2[e])
                       for e in range(experts)]}

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.use_fused:
            from dsaspec.ops.fused_moe import fused_moe

            out = torch.empty_like(x)
            # the router's ids are in [0, E) by construction: no host-synced range check (graph-safe)
            fused_moe(x.contiguous(), self.w13, self.w2, topk_ids, topk_weights, out, check_values=False)
            return out
        linear = row_invariant_ops().linear if self.row_invariant else F.linear
        per_expert = torch.zeros(x.shape[0], self.num_experts, dtype=torch.float32, device=x.device)
        per_expert.scatter_(1, topk_ids.long(), topk_weights)
        out = torch.zeros(x.shape[0], self.hidden, dtype=torch.float32, device=x.device)
        for e in range(self.num_experts):
            gate, up = linear(x, self.w13[e]).split(self.intermediate, dim=-1)
            out += per_expert[:, e:e + 1] * linear(F.silu(gate) * up, self.w2[e]).float()
        return out.to(x.dtype)


class MoE(nn.Module):
    """``mlp`` of an MoE layer: ``gate`` (:class:`Router`), ``experts`` (:class:`RoutedExperts`) and,
    with ``n_shared_experts`` > 0, ``shared_experts`` (a SwiGLU of ``n_shared_experts *
    moe_intermediate_size`` features, split like the dense FFN). ``forward(x [T, hidden])`` =
    routed + shared, one all-reduce over the TP group."""

    def __init__(self, config: ModelConfig, group: TPGroup, device=None, dtype=None):
        super().__init__()
        self.group = group
        self.gate = Router(config, device)
        self.experts = RoutedExperts(config, group, device, dtype)
        shared = config.n_shared_experts * config.moe_intermediate_size
        self.shared_experts = MLP(config, group, device, dtype, intermediate_size=shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_ids, topk_weights = self.gate(x)
        out = self.experts(x, topk_ids, topk_weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts.partial(x)
        return self.group.all_reduce(out)


def set_fused_moe(model: nn.Module, fused_moe: bool, row_invariant: bool) -> None:
    """Route every :class:`RoutedExperts` of ``model`` to the fused kernel when ``fused_moe`` (the
    model runs the Triton ops with ``RuntimeOptions.fused_moe``) and the model is not row-invariant
    (the torch path is the one whose per-token result has been checked not to depend on the other
    tokens)."""
    fused = fused_moe and not row_invariant
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            module.use_fused = fused
