"""One decoder layer: MLA with DSA and the dense SwiGLU, each behind an RMSNorm and a residual.
"""

from __future__ import annotations

from torch import nn

from dsaspec.configs.model_config import ModelConfig
from dsaspec.distributed.tp_group import TPGroup
from dsaspec.layers.attention.mla import ForwardState, MLAAttention
from dsaspec.layers.mlp import MLP
from dsaspec.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    """RMSNorm -> MLA with DSA -> residual -> RMSNorm -> SwiGLU -> residual (layer index ``layer``)."""

    def __init__(self, config: ModelConfig, layer: int, group: TPGroup, device=None, dtype=None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.self_attn = MLAAttention(config, layer, group, device, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.mlp = MLP(config, group, device, dtype)

    def forward(self, x, step: ForwardState, mla_cache, index_k_cache):
        x = x + self.self_attn(self.input_layernorm(x), step, mla_cache, index_k_cache)
        return x + self.mlp(self.post_attention_layernorm(x))
