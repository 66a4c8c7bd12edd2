"""Model configuration of the DSA decoder (DeepSeek-V3.2 / GLM-5 family), with HF field names.

A layer's FFN is a dense SwiGLU or, from ``first_k_dense_replace`` on (and in the MTP layer), the
mixture of experts of the HF configs (``n_routed_experts`` > 0: sigmoid router with the
``noaux_tc`` group-limited selection, routed and shared SwiGLU experts); ``n_routed_experts = 0``
is a dense model. FP8 block-scaled weights (``quantization_config``) are
:class:`~dsaspec.configs.quantization.Fp8Quantization`; :func:`check_implemented` refuses what is
not implemented (FP8 experts off the 128 x 128 blocks). The kernels specialise on the MQA cache
shape (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64 = 576 per token) and the indexer head dim
(128); ``validate`` refuses anything else with a clear error.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from dsaspec.configs.quantization import Fp8Quantization

# The shapes the DSA decode kernels are written for.
KERNEL_KV_LORA_RANK = 512
KERNEL_ROPE_DIM = 64
KERNEL_INDEX_HEAD_DIM = 128

_INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "index_n_heads", "index_head_dim", "index_topk", "max_position_embeddings",
)
_REQUIRED_HF_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "index_n_heads", "index_head_dim", "index_topk",
)
# HF model_type -> default indexer RoPE layout when the config does not say it; the DSA model types.
_INDEXER_INTERLEAVE_DEFAULT = {"glm_moe_dsa": True, "deepseek_v32": False}
_EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")   # HF spellings of the expert count
DENSE, SPARSE = "dense", "sparse"   # mlp_layer_types entries: dense FFN / mixture of experts
# The MoE fields at their dense-model values (n_routed_experts = 0: every FFN dense).
DENSE_FFN = dict(n_routed_experts=0, moe_intermediate_size=0, num_experts_per_tok=0, n_shared_experts=0,
                 first_k_dense_replace=0, moe_layer_freq=1, mlp_layer_types=None, n_group=1, topk_group=1,
                 topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
                 routed_scaling_factor=1.0)
# transformers' defaults (GlmMoeDsaConfig / DeepseekV32Config) for the MoE keys a config.json leaves out.
_HF_MOE_DEFAULTS = dict(moe_intermediate_size=2048, num_experts_per_tok=8, n_shared_experts=1,
                        first_k_dense_replace=3, moe_layer_freq=1, topk_method="noaux_tc",
                        scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5)
_HF_GROUP_DEFAULTS = {"glm_moe_dsa": (1, 1), "deepseek_v32": (8, 4)}   # (n_group, topk_group)
FULL, SHARED = "full", "shared"   # indexer_types entries: own indexer / reuse the previous full layer's top-k


@dataclass(frozen=True)
class ModelConfig:
    """One DSA decoder (+ MTP layer). Field names follow the HF ``config.json`` of GLM-5 /
    DeepSeek-V3.2; the few non-HF fields say so.

    ``rope_scaling``: None, or an HF YaRN dict (``type``/``rope_type`` ``"yarn"``, ``factor``,
    ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``mscale``,
    ``mscale_all_dim``). YaRN is applied whenever it is set (the HF convention).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_rope_interleave: bool
    rope_interleave: bool = True
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6
    # not an HF field: eps of q_a_layernorm, kv_a_layernorm and the indexer's k_norm (1e-6 in both
    # GLM-5 and DeepSeek-V3.2, while GLM-5's layer norms use rms_norm_eps = 1e-5)
    attn_norm_eps: float = 1e-6
    max_position_embeddings: int = 163840
    num_nextn_predict_layers: int = 1
    tie_word_embeddings: bool = False
    model_type: str = "deepseek_v32"
    # GLM-5.x IndexShare: per decoder layer "full" (own indexer) or "shared" (no indexer weights; reuses
    # the previous full layer's top-k); None = every layer full. The MTP layer always has an indexer.
    indexer_types: tuple[str, ...] | None = None
    # GLM-5.x: the draft steps reuse the draft extend's MTP top-k instead of running the MTP indexer
    index_share_for_mtp_iteration: bool = False
    # HF quantization_config, parsed: FP8 block-scaled weights, or None (bf16 / fp32 weights)
    quantization: Fp8Quantization | None = None
    # Mixture of experts (HF fields; DENSE_FFN values when n_routed_experts = 0). A decoder layer is
    # MoE per mlp_layer_types ("dense"/"sparse") when given, else from first_k_dense_replace on,
    # every moe_layer_freq-th; the MTP layer is MoE in an MoE model.
    n_routed_experts: int = 0
    moe_intermediate_size: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    mlp_layer_types: tuple[str, ...] | None = None
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # not an HF field (and not part of equality)
    name: str = field(default="custom", compare=False)

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", dict(self.rope_scaling))
        for name in ("indexer_types", "mlp_layer_types"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))

    # ---- derived shapes -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width of the MHA form: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Width of one MLA cache entry: latent + rope key (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """MLA softmax scale: ``qk_head_dim**-0.5``, times ``mscale(factor, mscale_all_dim)**2``
        under YaRN."""
        scale = self.qk_head_dim ** -0.5
        if self.rope_scaling is not None:
            m = yarn_mscale(float(self.rope_scaling["factor"]),
                            float(self.rope_scaling.get("mscale_all_dim", 0.0) or 0.0))
            scale *= m * m
        return scale

    @property
    def index_weight_scale(self) -> float:
        """Factor folded into the indexer head weights: ``index_head_dim**-0.5 * index_n_heads**-0.5``."""
        return self.index_head_dim ** -0.5 * self.index_n_heads ** -0.5

    def has_indexer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` runs its own indexer (``indexer_types`` "full"); a shared
        layer reuses the top-k of the closest full layer before it. The MTP layer
        (``layer == num_hidden_layers``) always has one."""
        if self.indexer_types is None or layer >= self.num_hidden_layers:
            return True
        return self.indexer_types[layer] == FULL

    @property
    def is_moe(self) -> bool:
        """Whether the model has mixture-of-experts FFNs (``n_routed_experts > 0``)."""
        return self.n_routed_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s FFN is the mixture of experts: per ``mlp_layer_types`` when
        given, else ``layer >= first_k_dense_replace and layer % moe_layer_freq == 0``; the MTP
        layer (``layer == num_hidden_layers``) is MoE in an MoE model."""
        if not self.is_moe:
            return False
        if layer >= self.num_hidden_layers:
            return True
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[layer] == SPARSE
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    # ---- validation -----------------------------------------------------------------------
    def validate(self) -> "ModelConfig":
        """Check every field; raise ``ValueError`` naming the field and what was expected.
        Returns self."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.num_nextn_predict_layers, int) or self.num_nextn_predict_layers not in (0, 1):
            raise ValueError("ModelConfig.num_nextn_predict_layers must be 0 or 1 (one MTP layer), "
                             f"got {self.num_nextn_predict_layers!r}")
        for name in ("indexer_rope_interleave", "rope_interleave", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.tie_word_embeddings:
            raise ValueError("ModelConfig.tie_word_embeddings=True is not supported (GLM-5 and "
                             "DeepSeek-V3.2 have a separate lm_head)")
        if self.kv_lora_rank != KERNEL_KV_LORA_RANK or self.qk_rope_head_dim != KERNEL_ROPE_DIM:
            raise ValueError(
                f"ModelConfig: the sparse MLA kernels need kv_lora_rank={KERNEL_KV_LORA_RANK} and "
                f"qk_rope_head_dim={KERNEL_ROPE_DIM} (a 576-wide cache), got kv_lora_rank="
                f"{self.kv_lora_rank}, qk_rope_head_dim={self.qk_rope_head_dim}")
        if self.index_head_dim != KERNEL_INDEX_HEAD_DIM:
            raise ValueError(f"ModelConfig.index_head_dim must be {KERNEL_INDEX_HEAD_DIM} (the indexer "
                             f"kernel's head dim), got {self.index_head_dim}")
        if self.index_head_dim <= self.qk_rope_head_dim:
            raise ValueError("ModelConfig.index_head_dim must exceed qk_rope_head_dim (RoPE covers "
                             "the first qk_rope_head_dim dims of an indexer head)")
        for name in ("rope_theta", "rms_norm_eps", "attn_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ModelConfig.{name} must be a positive number, got {value!r}")
        if self.rope_scaling is not None:
            _validate_yarn(self.rope_scaling)
        if self.indexer_types is not None:
            types = self.indexer_types
            if len(types) != self.num_hidden_layers or any(t not in (FULL, SHARED) for t in types):
                raise ValueError(f"ModelConfig.indexer_types must hold {self.num_hidden_layers} entries "
                                 f"'{FULL}' or '{SHARED}', got {list(types)!r}")
            if types[0] != FULL:
                raise ValueError("ModelConfig.indexer_types[0] must be 'full': a shared layer reuses the "
                                 "top-k of an earlier full layer")
        if self.model_type not in _INDEXER_INTERLEAVE_DEFAULT:
            raise ValueError(f"ModelConfig.model_type must be a DSA model type, one of "
                             f"{sorted(_INDEXER_INTERLEAVE_DEFAULT)}, got {self.model_type!r}")
        if not isinstance(self.index_share_for_mtp_iteration, bool):
            raise ValueError(f"ModelConfig.index_share_for_mtp_iteration must be a bool, "
                             f"got {self.index_share_for_mtp_iteration!r}")
        if self.quantization is not None and not isinstance(self.quantization, Fp8Quantization):
            raise ValueError(f"ModelConfig.quantization must be an Fp8Quantization or None, got {self.quantization!r}")
        self._validate_moe()
        return self

    def _validate_moe(self) -> None:
        if isinstance(self.n_routed_experts, bool) or not isinstance(self.n_routed_experts, int) \
                or self.n_routed_experts < 0:
            raise ValueError(f"ModelConfig.n_routed_experts must be an int >= 0, got {self.n_routed_experts!r}")
        if not self.is_moe:
            changed = [k for k, v in DENSE_FFN.items() if getattr(self, k) != v]
            if changed:
                raise ValueError(f"ModelConfig.n_routed_experts is 0 (every FFN dense) but {changed} differ "
                                 "from their dense values (dsaspec.configs.model_config.DENSE_FFN)")
            return
        for name, low in (("moe_intermediate_size", 1), ("num_experts_per_tok", 1), ("n_group", 1),
                          ("topk_group", 1), ("moe_layer_freq", 1), ("n_shared_experts", 0),
                          ("first_k_dense_replace", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"ModelConfig.{name} must be an int >= {low}, got {value!r}")
        if self.topk_method != "noaux_tc":
            raise ValueError(f"ModelConfig.topk_method: only 'noaux_tc' (sigmoid scores, correction bias, "
                             f"group-limited top-k) is implemented, got {self.topk_method!r}")
        if self.scoring_func != "sigmoid":
            raise ValueError(f"ModelConfig.scoring_func: only 'sigmoid' is implemented, got {self.scoring_func!r}")
        experts, groups = self.n_routed_experts, self.n_group
        if experts % groups or experts // groups < 2:
            raise ValueError(f"ModelConfig.n_group ({groups}) must divide n_routed_experts ({experts}) into "
                             "groups of >= 2 experts (a group scores the sum of its top 2)")
        if self.topk_group > groups:
            raise ValueError(f"ModelConfig.topk_group ({self.topk_group}) must be <= n_group ({groups})")
        if self.num_experts_per_tok > self.topk_group * (experts // groups):
            raise ValueError(f"ModelConfig.num_experts_per_tok ({self.num_experts_per_tok}) exceeds the "
                             f"{self.topk_group * (experts // groups)} experts of topk_group={self.topk_group} "
                             f"groups of {experts // groups}")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"ModelConfig.norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")
        value = self.routed_scaling_factor
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"ModelConfig.routed_scaling_factor must be a positive number, got {value!r}")
        if self.mlp_layer_types is not None:
            kinds = self.mlp_layer_types
            if len(kinds) != self.num_hidden_layers or any(k not in (DENSE, SPARSE) for k in kinds):
                raise ValueError(f"ModelConfig.mlp_layer_types must hold {self.num_hidden_layers} entries "
                                 f"'{DENSE}' or '{SPARSE}', got {list(kinds)!r}")
        if not any(self.is_moe_layer(i) for i in range(self.num_hidden_layers)):
            raise ValueError(f"ModelConfig has n_routed_experts={experts} but no MoE decoder layer "
                             f"(first_k_dense_replace={self.first_k_dense_replace}, num_hidden_layers="
                             f"{self.num_hidden_layers}); a dense model has n_routed_experts=0")

    # ---- HF dicts ---------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], name: str = "custom") -> "ModelConfig":
        """Build from an HF ``config.json`` dict (GLM-5 ``glm_moe_dsa`` or ``deepseek_v32``);
        unknown keys (tokens, ...) are ignored. Accepts ``rope_theta``/``rope_scaling`` and the
        newer ``rope_parameters``. MoE keys left out take transformers' defaults; a config whose
        decoder layers are all dense reads as a dense model. Raises ``ValueError`` for a missing
        key or a bad value."""
        if not isinstance(hf, dict):
            raise ValueError(f"from_hf_dict expects a dict, got {type(hf).__name__}")
        missing = [k for k in _REQUIRED_HF_KEYS if hf.get(k) is None]
        if missing:
            raise ValueError(f"HF config is missing required key(s) {missing} "
                             "(q_lora_rank must be set: the DSA models all use a q latent)")
        model_type = str(hf.get("model_type", "deepseek_v32"))
        rope_params = dict(hf.get("rope_parameters") or {})
        rope_theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_scaling = hf.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") not in ("default", None):
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind in ("default", None):
                rope_scaling = None
        interleave_default = _INDEXER_INTERLEAVE_DEFAULT.get(model_type, False)
        kwargs = {k: hf[k] for k in _REQUIRED_HF_KEYS}
        config = cls(
            **kwargs,
            indexer_rope_interleave=hf.get("indexer_rope_interleave", interleave_default),
            rope_interleave=hf.get("rope_interleave", True),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=hf.get("max_position_embeddings", 163840),
            num_nextn_predict_layers=hf.get("num_nextn_predict_layers", 0),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            model_type=model_type,
            indexer_types=indexer_types_from_hf(hf),
            index_share_for_mtp_iteration=hf.get("index_share_for_mtp_iteration", False),
            quantization=Fp8Quantization.from_hf(hf.get("quantization_config")),
            **_moe_from_hf(hf, model_type),
            name=name,
        )
        return config.validate()

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF-named fields as a ``config.json`` dict (``from_hf_dict`` reads it back equal)."""
        out = {k: getattr(self, k) for k in _REQUIRED_HF_KEYS}
        out.update(
            model_type=self.model_type,
            indexer_rope_interleave=self.indexer_rope_interleave,
            rope_interleave=self.rope_interleave,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            num_nextn_predict_layers=self.num_nextn_predict_layers,
            tie_word_embeddings=self.tie_word_embeddings,
            num_key_value_heads=self.num_attention_heads,   # MLA: one KV head per attention head (HF field)
            index_share_for_mtp_iteration=self.index_share_for_mtp_iteration,
        )
        if self.indexer_types is not None:
            out["indexer_types"] = list(self.indexer_types)
        # explicit mlp_layer_types: transformers ignores moe_layer_freq; a dense model declares every
        # layer dense (an HF reader builds no MoE layer)
        if self.is_moe:
            out.update({k: getattr(self, k) for k in DENSE_FFN if k != "mlp_layer_types"})
        else:
            out.update(n_routed_experts=0, first_k_dense_replace=self.num_hidden_layers)
        out["mlp_layer_types"] = [SPARSE if self.is_moe_layer(i) else DENSE for i in range(self.num_hidden_layers)]
        if self.rope_scaling is not None:
            out["rope_scaling"] = dict(self.rope_scaling)
        if self.quantization is not None:
            out["quantization_config"] = self.quantization.to_hf()
        return out

    def replace(self, **changes) -> "ModelConfig":
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes).validate()


def _moe_from_hf(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The MoE fields of HF config ``hf`` (DENSE_FFN when no decoder layer is MoE)."""
    experts = next((hf[k] for k in _EXPERT_KEYS if hf.get(k) is not None), 0)
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 0:
        raise ValueError(f"HF config n_routed_experts must be an int >= 0, got {experts!r}")
    if experts == 0:
        return dict(DENSE_FFN)
    groups = _HF_GROUP_DEFAULTS.get(model_type, (1, 1))
    moe = {k: hf.get(k) if hf.get(k) is not None else v for k, v in _HF_MOE_DEFAULTS.items()}
    moe.update(n_routed_experts=experts, n_group=hf.get("n_group") or groups[0],
               topk_group=hf.get("topk_group") or groups[1], mlp_layer_types=None)
    layers = hf["num_hidden_layers"]
    kinds = hf.get("mlp_layer_types")
    for name in ("first_k_dense_replace", "moe_layer_freq"):
        if isinstance(moe[name], bool) or not isinstance(moe[name], int) or moe[name] < (name == "moe_layer_freq"):
            raise ValueError(f"HF config {name} must be an int >= {int(name == 'moe_layer_freq')}, got {moe[name]!r}")
    derived = [SPARSE if i >= moe["first_k_dense_replace"] and i % moe["moe_layer_freq"] == 0 else DENSE
               for i in range(layers)]
    if kinds is not None:
        if not isinstance(kinds, list):
            raise ValueError(f"HF config mlp_layer_types must be a list ('dense' / 'sparse' per layer), got {kinds!r}")
        if kinds != derived:
            moe["mlp_layer_types"] = tuple(kinds)
        derived = kinds
    if SPARSE not in derived:
        return dict(DENSE_FFN)
    moe["routed_scaling_factor"] = float(moe["routed_scaling_factor"])
    return moe


def check_implemented(hf: dict[str, Any]) -> None:
    """Raise ``ValueError`` if HF config ``hf`` (one :meth:`ModelConfig.from_hf_dict` accepts) claims
    what this runtime does not implement: FP8 routed experts whose ``moe_intermediate_size`` or
    ``hidden_size`` is not a multiple of 128 (each expert's gate, up and down projections are
    stored in whole 128 x 128 blocks)."""
    quant = hf.get("quantization_config")
    experts = next((hf[k] for k in _EXPERT_KEYS if hf.get(k) is not None), 0)
    if not (quant and experts):
        return
    for key in ("moe_intermediate_size", "hidden_size"):
        value = hf.get(key)
        if isinstance(value, int) and value % 128:
            raise ValueError(f"{key} = {value}: FP8 routed experts (quantization_config with {experts} "
                             "routed experts) need a multiple of 128 (weight_block_size [128, 128])")


def tp_rank_config(config: ModelConfig, tp: int, name: str) -> ModelConfig:
    """The TP 1 config whose model computes what one rank of ``config`` at tensor-parallel size
    ``tp`` computes (dsaspec's split, which is SGLang's and vLLM's default TP split without DP
    attention or expert parallelism): ``num_attention_heads / tp`` heads (``q_b_proj``,
    ``kv_b_proj``, ``o_proj``), ``intermediate_size / tp`` dense FFN features, every routed expert
    and the shared expert(s) at ``moe_intermediate_size / tp`` features (the router still scores
    all ``n_routed_experts`` and routes as the full model does), and the rank's vocab shard of the
    LM head and embedding, ``ceil(vocab_size / (64 tp)) * 64`` rows (``padded_vocab_size`` of
    :mod:`dsaspec.layers.vocab_parallel`). Replicated, so unchanged: the q / kv latent projections
    and norms, the indexer, the router, ``eh_proj``. What one GPU cannot run is left out: the
    all-reduces of each layer (attention ``o_proj``, FFN / MoE), of the embedding, and the argmax
    exchange or logits gather of each LM head. Raises ``ValueError`` naming a field ``tp`` does
    not divide."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    split = ("num_attention_heads", "intermediate_size") + (("moe_intermediate_size",) if config.is_moe else ())
    for field_name in split:
        if getattr(config, field_name) % tp:
            raise ValueError(f"tp {tp} must divide ModelConfig.{field_name} ({getattr(config, field_name)})")
    changes = {field_name: getattr(config, field_name) // tp for field_name in split}
    return config.replace(**changes, vocab_size=-(-config.vocab_size // (64 * tp)) * 64, name=name)


def indexer_types_from_hf(hf: dict[str, Any]) -> tuple[str, ...] | None:
    """Per-layer indexer types of an HF config: ``indexer_types`` when given; else from
    ``index_topk_pattern`` (``"F"``/``"S"`` per layer); else from ``index_topk_freq`` and
    ``index_skip_topk_offset``: layer ``i`` is shared iff ``max(i - offset + 1, 0) % freq != 0``
    (GLM-5.2: freq 4, offset 3 -> full layers 0, 1, 2, 6, 10, ...). None when every layer is full."""
    layers = hf["num_hidden_layers"]
    if hf.get("indexer_types") is not None:
        types = tuple(hf["indexer_types"])
    elif hf.get("index_topk_pattern") is not None:
        letters = {"F": FULL, "S": SHARED}
        pattern = hf["index_topk_pattern"]
        if any(c not in letters for c in pattern):
            raise ValueError(f"HF config index_topk_pattern must hold 'F'/'S' per layer, got {pattern!r}")
        types = tuple(letters[c] for c in pattern)
    else:
        freq = hf.get("index_topk_freq") or 1
        if not isinstance(freq, int) or freq < 1:
            raise ValueError(f"HF config index_topk_freq must be a positive int, got {freq!r}")
        if freq == 1:
            return None
        if hf.get("index_skip_topk_offset") is None:
            raise ValueError("HF config sets index_topk_freq > 1 without index_skip_topk_offset or "
                             "indexer_types: which layers share the top-k is ambiguous")
        offset = int(hf["index_skip_topk_offset"])
        types = tuple(SHARED if max(i - offset + 1, 0) % freq else FULL for i in range(layers))
    return None if all(t == FULL for t in types) else types


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN attention temperature: ``0.1 * mscale * ln(factor) + 1`` (1 when factor <= 1)."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def _validate_yarn(scaling: dict) -> None:
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("yarn", "deepseek_yarn"):
        raise ValueError(f"ModelConfig.rope_scaling: only YaRN is supported, got type {kind!r}")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in scaling:
            raise ValueError(f"ModelConfig.rope_scaling needs {key!r} for YaRN, got keys {sorted(scaling)}")
    if not float(scaling["factor"]) >= 1.0:
        raise ValueError(f"ModelConfig.rope_scaling['factor'] must be >= 1, got {scaling['factor']!r}")


_DEEPSEEK_YARN = {
    "type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
}

_GLM5_MOE = dict(n_routed_experts=256, moe_intermediate_size=2048, num_experts_per_tok=8, n_shared_experts=1,
                 first_k_dense_replace=3, n_group=1, topk_group=1, routed_scaling_factor=2.5)
_DEEPSEEK_V32_MOE = dict(_GLM5_MOE, n_group=8, topk_group=4)

PRESETS: dict[str, ModelConfig] = {
    # The released architectures: GLM-5 (glm_moe_dsa) and DeepSeek-V3.2, MoE from layer 3 on.
    "glm5-moe": ModelConfig(
        vocab_size=154880, hidden_size=6144, intermediate_size=12288, num_hidden_layers=78,
        num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
        qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32, index_head_dim=128,
        index_topk=2048, indexer_rope_interleave=True, rope_interleave=True, rope_theta=1e6,
        rms_norm_eps=1e-5, max_position_embeddings=202752, num_nextn_predict_layers=1,
        model_type="glm_moe_dsa", **_GLM5_MOE, name="glm5-moe"),
    "deepseek-v32-moe": ModelConfig(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
        num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64, index_head_dim=128,
        index_topk=2048, indexer_rope_interleave=False, rope_interleave=True, rope_theta=10000.0,
        rope_scaling=_DEEPSEEK_YARN, rms_norm_eps=1e-6, max_position_embeddings=163840,
        num_nextn_predict_layers=1, model_type="deepseek_v32", **_DEEPSEEK_V32_MOE, name="deepseek-v32-moe"),
    # Tests and the CPU default: kernel-relevant dims kept (576 cache, 128 indexer head),
    # top-k 64 so sparsity happens in short sequences; an odd vocab catches tiling mistakes.
    "tiny": ModelConfig(
        vocab_size=1031, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=64,
        qk_rope_head_dim=64, v_head_dim=64, index_n_heads=4, index_head_dim=128, index_topk=64,
        indexer_rope_interleave=True, rope_interleave=True, rope_theta=10000.0, rms_norm_eps=1e-5,
        max_position_embeddings=4096, num_nextn_predict_layers=1, model_type="glm_moe_dsa",
        name="tiny"),
}
# The dense surrogates: the released attention / indexer / vocab shapes with a dense FFN in every
# layer at the HF dense intermediate_size.
PRESETS["glm5"] = PRESETS["glm5-moe"].replace(**DENSE_FFN, name="glm5")
PRESETS["deepseek_v32"] = PRESETS["deepseek-v32-moe"].replace(**DENSE_FFN, name="deepseek_v32")
# Tests and CPU runs of the MoE: tiny with MoE from layer 1 on (and in the MTP layer), 8 experts in
# 4 groups of 2, 2 groups and 3 experts per token, one shared expert.
PRESETS["tiny-moe"] = PRESETS["tiny"].replace(
    n_routed_experts=8, moe_intermediate_size=128, num_experts_per_tok=3, n_shared_experts=1,
    first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, name="tiny-moe")

# GLM-5.2: GLM-5's shapes with IndexShare (a full indexer every 4th layer from layer 2 on, and
# the draft steps reuse the draft extend's MTP top-k) and a 1M-token context.
PRESETS["glm52"] = PRESETS["glm5"].replace(
    rope_theta=8e6, max_position_embeddings=1048576, index_share_for_mtp_iteration=True,
    indexer_types=indexer_types_from_hf(dict(num_hidden_layers=78, index_topk_freq=4,
                                             index_skip_topk_offset=3)), name="glm52")
# Benchmarks: GLM-5 attention, indexer and vocab shapes, 2 layers and a modest dense FFN.
PRESETS["bench"] = PRESETS["glm5"].replace(num_hidden_layers=2, intermediate_size=4096,
                                           max_position_embeddings=1048576, name="bench")
# End-to-end benchmark: GLM-5 shapes at 16 dense layers (about 13 GB of bf16 weights read per
# decode step on one GPU), a per-step latency of the order a GLM-5 deployment shows per token.
PRESETS["e2e"] = PRESETS["glm5"].replace(num_hidden_layers=16, max_position_embeddings=1048576, name="e2e")
# One rank of the FP8 deployments at TP 8 (tp_rank_config), at full depth + MTP: GLM-5 (8 of 64
# heads) and DeepSeek-V3.2 (16 of 128 heads, ue8m0 activation scales as its quantization_config),
# all 256 routed experts at 2048 / 8 = 256 features. FP8 e4m3 with 128 x 128 block scales where the
# official checkpoints store it (dsaspec.configs.quantization); one GPU times the rank's compute.
PRESETS["glm5-fp8-tp8-rank"] = tp_rank_config(PRESETS["glm5-moe"].replace(quantization=Fp8Quantization()), 8,
                                              "glm5-fp8-tp8-rank")
PRESETS["deepseek-v32-fp8-tp8-rank"] = tp_rank_config(
    PRESETS["deepseek-v32-moe"].replace(quantization=Fp8Quantization(scale_fmt="ue8m0")), 8,
    "deepseek-v32-fp8-tp8-rank")


def get_config(name: str, **overrides) -> ModelConfig:
    """A preset by name (``glm5``, ``glm52``, ``deepseek_v32`` and their MoE forms ``glm5-moe``,
    ``deepseek-v32-moe``; one FP8 rank at TP 8 ``glm5-fp8-tp8-rank``, ``deepseek-v32-fp8-tp8-rank``;
    ``tiny``, ``tiny-moe``, ``bench``, ``e2e``), with optional field overrides, validated."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)
