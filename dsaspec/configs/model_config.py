"""Model configuration of the DSA decoder (DeepSeek-V3.2 / GLM-5 family), with HF field names.

The runtime's FFN is dense SwiGLU in every layer (MoE is orthogonal to this project), so the MoE
fields of the HF configs are not represented: the presets are the released shapes with dense FFNs,
and :func:`check_implemented` refuses a checkpoint config that claims MoE layers. FP8 block-scaled
weights (``quantization_config``) are :class:`~dsaspec.configs.quantization.Fp8Quantization`. The kernels specialise on the MQA cache shape (``kv_lora_rank`` 512 +
``qk_rope_head_dim`` 64 = 576 per token) and the indexer head dim (128); ``validate`` refuses
anything else with a clear error.
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
_HF_FIRST_K_DENSE = 3     # HF's default first_k_dense_replace (GLM-5, DeepSeek-V3.2)
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
    # not an HF field (and not part of equality)
    name: str = field(default="custom", compare=False)

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", dict(self.rope_scaling))
        if isinstance(self.indexer_types, list):
            object.__setattr__(self, "indexer_types", tuple(self.indexer_types))

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
        return self

    # ---- HF dicts ---------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], name: str = "custom") -> "ModelConfig":
        """Build from an HF ``config.json`` dict (GLM-5 ``glm_moe_dsa`` or ``deepseek_v32``);
        unknown keys (MoE, tokens, ...) are ignored. Accepts ``rope_theta``/``rope_scaling`` and
        the newer ``rope_parameters``. Raises ``ValueError`` for a missing key or a bad value."""
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
            first_k_dense_replace=self.num_hidden_layers,  # every layer dense in this runtime
            num_key_value_heads=self.num_attention_heads,   # MLA: one KV head per attention head (HF field)
            index_share_for_mtp_iteration=self.index_share_for_mtp_iteration,
        )
        if self.indexer_types is not None:
            out["indexer_types"] = list(self.indexer_types)
        if self.rope_scaling is not None:
            out["rope_scaling"] = dict(self.rope_scaling)
        if self.quantization is not None:
            out["quantization_config"] = self.quantization.to_hf()
        return out

    def replace(self, **changes) -> "ModelConfig":
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes).validate()


def check_implemented(hf: dict[str, Any]) -> None:
    """Raise ``ValueError`` if HF config ``hf`` (one :meth:`ModelConfig.from_hf_dict` accepts) claims
    what this runtime does not implement yet: MoE layers (``mlp_layer_types`` entries other than
    ``"dense"``; without it, an expert count > 0 and layers from ``first_k_dense_replace`` (HF
    default 3) on, every ``moe_layer_freq``-th). Loading such a checkpoint's tensors into dense
    layers would run another model than the config describes. (A ``quantization_config`` is
    checked by :meth:`ModelConfig.from_hf_dict`.)"""
    layers = hf["num_hidden_layers"]
    kinds = hf.get("mlp_layer_types")
    if kinds is not None:
        if not isinstance(kinds, list):
            raise ValueError(f"HF config mlp_layer_types must be a list ('dense' / 'sparse' per layer), got {kinds!r}")
        moe = sum(kind != "dense" for kind in kinds)
        why = f"mlp_layer_types {kinds!r}"
    else:
        experts = next((hf[k] for k in _EXPERT_KEYS if hf.get(k) is not None), 0)
        first, freq = hf.get("first_k_dense_replace", _HF_FIRST_K_DENSE), hf.get("moe_layer_freq") or 1
        for name, value in (("first_k_dense_replace", first), ("moe_layer_freq", freq), ("n_routed_experts", experts)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"HF config {name} must be an int >= 0, got {value!r}")
        moe = sum(i % freq == 0 for i in range(first, layers)) if experts else 0
        why = f"{experts} routed experts from layer first_k_dense_replace = {first} on"
    if moe:
        raise ValueError(f"the config has mixture-of-experts FFNs in {moe} of {layers} layers ({why}): MoE is "
                         "not implemented yet (every layer here is a dense SwiGLU FFN)")


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

PRESETS: dict[str, ModelConfig] = {
    # GLM-5 (glm_moe_dsa) attention/indexer/vocab shapes; FFN dense in every layer at the HF
    # dense intermediate_size (the real model has MoE from layer 3 on).
    "glm5": ModelConfig(
        vocab_size=154880, hidden_size=6144, intermediate_size=12288, num_hidden_layers=78,
        num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
        qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32, index_head_dim=128,
        index_topk=2048, indexer_rope_interleave=True, rope_interleave=True, rope_theta=1e6,
        rms_norm_eps=1e-5, max_position_embeddings=202752, num_nextn_predict_layers=1,
        model_type="glm_moe_dsa", name="glm5"),
    "deepseek_v32": ModelConfig(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
        num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64, index_head_dim=128,
        index_topk=2048, indexer_rope_interleave=False, rope_interleave=True, rope_theta=10000.0,
        rope_scaling=_DEEPSEEK_YARN, rms_norm_eps=1e-6, max_position_embeddings=163840,
        num_nextn_predict_layers=1, model_type="deepseek_v32", name="deepseek_v32"),
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


def get_config(name: str, **overrides) -> ModelConfig:
    """A preset by name (``glm5``, ``glm52``, ``deepseek_v32``, ``tiny``, ``bench``, ``e2e``), with
    optional field overrides, validated."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)
