"""The MTP (NextN) layer of DeepSeek-V3.2 / GLM-5: a decoder layer that drafts the next token.
"""

from __future__ import annotations

from torch import nn

from dsaspec.configs.model_config import ModelConfig
from dsaspec.distributed.tp_group import TPGroup
from dsaspec.layers.linear import make_linear
from dsaspec.layers.norm import RMSNorm
from dsaspec.models.decoder_layer import DecoderLayer


class SharedHead(nn.Module):
    """The MTP layer's ``shared_head``: its own norm; the LM head itself is the target's."""

    def __init__(self, config: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)


class MTPLayer(DecoderLayer):
    """The MTP (NextN) layer: ``enorm``, ``hnorm``, ``eh_proj`` (2 hidden -> hidden, embedding
    first, replicated), one full decoder layer (the inherited parameters) and ``shared_head.norm``;
    it shares the target's embedding and LM head."""

    def __init__(self, config: ModelConfig, group: TPGroup, device=None, dtype=None):
        super().__init__(config, config.num_hidden_layers, group, device, dtype)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.eh_proj = make_linear(2 * config.hidden_size, config.hidden_size, device, dtype)
        self.shared_head = SharedHead(config, device, dtype)
