"""One decoder layer: MLA with DSA and the FFN (dense SwiGLU or the mixture of experts), each behind an
RMSNorm and a residual.
"""

from __future__ import annotations

from torch import nn

from dsaspec.configs.model_config import ModelConfig
from dsaspec.distributed.tp_group import TPGroup
from dsaspec.layers.attention.mla import ForwardState, MLAAttention
from dsaspec.layers.mlp import MLP
from dsaspec.layers.moe import MoE
from dsaspec.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    """RMSNorm -> MLA with DSA -> residual -> RMSNorm -> FFN -> residual (layer index ``layer``); the
    FFN is :class:`MoE` where ``config.is_moe_layer(layer)``, else the dense :class:`MLP`."""

    def __init__(self, config: ModelConfig, layer: int, group: TPGroup, device=None, dtype=None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.self_attn = MLAAttention(config, layer, group, device, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        ffn = MoE if config.is_moe_layer(layer) else MLP
        self.mlp = ffn(config, group, device, dtype)

    def forward(self, x, step: ForwardState, mla_cache, index_k_cache, residual=None):
        """The layer over ``x + residual`` (``x`` alone when ``residual`` is None) -> ``(ffn, residual)``,
        whose sum is the layer's output: the residual adds run fused into the next norm (this
        layer's post-attention norm, the next layer's input norm or the final norm). The input norm
        quantizes for the attention's FP8 input GEMMs where they share one format
        (``self_attn.input_quant``), the post-attention norm for the FFN's (``mlp.input_quant``)."""
        quant = self.self_attn.input_quant
        if residual is None:
            h, residual = self.input_layernorm(x, quant=quant), x
        else:
            h, residual = self.input_layernorm(x, residual, quant)
        h, residual = self.post_attention_layernorm(self.self_attn(h, step, mla_cache, index_k_cache), residual,
                                                    self.mlp.input_quant)
        return self.mlp(h), residual
