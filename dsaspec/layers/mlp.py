"""The dense SwiGLU feed-forward layer, split over a tensor-parallel group by its intermediate features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsaspec.configs.model_config import ModelConfig
from dsaspec.distributed.tp_group import TPGroup
from dsaspec.layers.fp8_linear import ActQuant, Fp8Input, act_quant_of
from dsaspec.layers.fused_linear import HoldsFusedLinear, fuse_linears
from dsaspec.layers.linear import COLUMN, ROW, make_linear


class MLP(HoldsFusedLinear, nn.Module):
    """Dense SwiGLU: ``down(silu(gate(x)) * up(x))`` of ``intermediate_size`` features (default
    ``config.intermediate_size``); over a TP group the intermediate features are split
    (``gate_proj`` / ``up_proj`` column parallel, ``down_proj`` row parallel) and one all-reduce
    sums the partial outputs. ``silu(gate) * up`` is one Triton kernel when ``use_triton`` (set by
    :class:`DSAModel`; :func:`~dsaspec.ops.silu_and_mul.silu_and_mul`, bit for bit the two torch
    launches), else ``F.silu`` and the multiply."""

    use_triton: bool = False

    def __init__(self, config: ModelConfig, group: TPGroup, device=None, dtype=None, *,
                 intermediate_size: int | None = None):
        super().__init__()
        self.group = group
        tp = dict(group=group)
        width = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = make_linear(config.hidden_size, width, device, dtype, split=COLUMN, **tp)
        self.up_proj = make_linear(config.hidden_size, width, device, dtype, split=COLUMN, **tp)
        self.down_proj = make_linear(width, config.hidden_size, device, dtype, split=ROW, **tp)
        self.gate_up = None
        self.input_quant: ActQuant | None = None

    def fuse_projections(self) -> None:
        """One GEMM for this rank's ``gate_proj`` and ``up_proj`` shards
        (:func:`~dsaspec.layers.fused_linear.fuse_linears`; nothing changes where it refuses them);
        where both are FP8 of one ``scale_fmt``, ``input_quant`` so that the norm before the layer
        writes their codes (:func:`~dsaspec.layers.fp8_linear.act_quant_of`; None: they quantize)."""
        self.gate_up = fuse_linears([self.gate_proj, self.up_proj])
        self.input_quant = act_quant_of([self.gate_proj, self.up_proj])

    def partial(self, x: torch.Tensor | Fp8Input) -> torch.Tensor:
        """This rank's partial output (the sum over the group is the layer's output); ``x`` may be an
        :class:`~dsaspec.layers.fp8_linear.Fp8Input` with :attr:`input_quant`'s codes."""
        gate, up = (self.gate_proj(x), self.up_proj(x)) if self.gate_up is None else self.gate_up(x)
        if self.use_triton:
            from dsaspec.ops.silu_and_mul import silu_and_mul

            return self.down_proj(silu_and_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)

    def forward(self, x: torch.Tensor | Fp8Input) -> torch.Tensor:
        return self.group.all_reduce(self.partial(x))
