"""The dense SwiGLU feed-forward layer, split over a tensor-parallel group by its intermediate features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsaspec.configs.model_config import ModelConfig
from dsaspec.distributed.tp_group import TPGroup
from dsaspec.layers.linear import COLUMN, ROW, make_linear


class MLP(nn.Module):
    """Dense SwiGLU: ``down(silu(gate(x)) * up(x))``; over a TP group the intermediate features are
    split (``gate_proj`` / ``up_proj`` column parallel, ``down_proj`` row parallel) and one
    all-reduce sums the partial outputs."""

    def __init__(self, config: ModelConfig, group: TPGroup, device=None, dtype=None):
        super().__init__()
        self.group = group
        tp = dict(group=group)
        self.gate_proj = make_linear(config.hidden_size, config.intermediate_size, device, dtype, split=COLUMN, **tp)
        self.up_proj = make_linear(config.hidden_size, config.intermediate_size, device, dtype, split=COLUMN, **tp)
        self.down_proj = make_linear(config.intermediate_size, config.hidden_size, device, dtype, split=ROW, **tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))
