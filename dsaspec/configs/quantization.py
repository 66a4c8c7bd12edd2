"""The ``quantization_config`` of FP8 block-scaled checkpoints (DeepSeek-V3 / V3.2, GLM-5 FP8), and
which linear layers it quantizes.

Accepted: ``{quant_method: "fp8", fmt: "e4m3", weight_block_size: [128, 128]}`` with optional
``activation_scheme: "dynamic"``, ``scale_fmt: "ue8m0"`` (activation scales rounded to powers of two,
as DeepSeek-V3.2's config) and ``modules_to_not_convert`` / ``ignored_layers`` (module names kept in
bf16). Anything else is refused with a ``ValueError`` naming the key.

Which projections are FP8 (each as ``weight`` e4m3 + ``weight_scale_inv`` fp32 in the checkpoint):
every linear layer of the attention (``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``,
``kv_b_proj``, ``o_proj``, the indexer's ``wq_b`` and ``wk``) and of the FFNs, except the modules
the official checkpoints store in bf16 (:data:`ALWAYS_BF16`: the indexer's ``weights_proj``, the MTP
layer's ``eh_proj``, the MoE router ``gate``) and those the config names. The embedding, the LM head
and the norms are never quantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BLOCK_SIZE = (128, 128)
ALWAYS_BF16 = ("weights_proj", "eh_proj", "gate")
_KEYS = ("quant_method", "fmt", "weight_block_size", "activation_scheme", "scale_fmt",
         "modules_to_not_convert", "ignored_layers")


@dataclass(frozen=True)
class Fp8Quantization:
    """A parsed FP8 ``quantization_config``: ``scale_fmt`` (None or ``"ue8m0"``) of the activation
    scales and ``modules_to_not_convert`` (module names or dotted name pieces kept in bf16)."""

    scale_fmt: str | None = None
    modules_to_not_convert: tuple[str, ...] = ()

    def __post_init__(self):
        if self.scale_fmt not in (None, "ue8m0"):
            raise ValueError(f"quantization_config.scale_fmt: expected 'ue8m0' or absent, got {self.scale_fmt!r}")
        if isinstance(self.modules_to_not_convert, list):
            object.__setattr__(self, "modules_to_not_convert", tuple(self.modules_to_not_convert))
        if not all(isinstance(m, str) and m for m in self.modules_to_not_convert):
            raise ValueError("quantization_config.modules_to_not_convert: expected a list of module names, "
                             f"got {self.modules_to_not_convert!r}")

    @classmethod
    def from_hf(cls, quant: Any) -> "Fp8Quantization | None":
        """Parse an HF ``quantization_config`` (None or ``{}``: not quantized). Raises ``ValueError``
        naming the key for an unknown key, ``quant_method``, ``fmt``, ``weight_block_size``,
        ``activation_scheme`` or ``scale_fmt``."""
        if quant is None or quant == {}:
            return None
        if not isinstance(quant, dict):
            raise ValueError(f"quantization_config: expected an object, got {quant!r}")
        unknown = sorted(set(quant) - set(_KEYS))
        if unknown:
            raise ValueError(f"quantization_config: unknown key(s) {unknown}; known: {list(_KEYS)}")
        method = quant.get("quant_method")
        if method != "fp8":
            raise ValueError(f"quantization_config.quant_method: only 'fp8' (block-scaled e4m3) is "
                             f"implemented, got {method!r}")
        if quant.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config.fmt: expected 'e4m3', got {quant['fmt']!r}")
        block = quant.get("weight_block_size")
        if not isinstance(block, (list, tuple)) or tuple(block) != BLOCK_SIZE:
            raise ValueError(f"quantization_config.weight_block_size: expected {list(BLOCK_SIZE)} (per-tensor "
                             f"and other block sizes are not implemented), got {block!r}")
        if quant.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError("quantization_config.activation_scheme: expected 'dynamic' (activations "
                             f"quantized at run time), got {quant['activation_scheme']!r}")
        skip = []
        for key in ("modules_to_not_convert", "ignored_layers"):
            names = quant.get(key) or []
            if not isinstance(names, list):
                raise ValueError(f"quantization_config.{key}: expected a list of module names, got {names!r}")
            skip += names
        return cls(scale_fmt=quant.get("scale_fmt"), modules_to_not_convert=tuple(skip))

    def to_hf(self) -> dict[str, Any]:
        """The ``quantization_config`` dict (``from_hf`` reads it back equal)."""
        out: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK_SIZE),
                               "activation_scheme": "dynamic"}
        if self.scale_fmt is not None:
            out["scale_fmt"] = self.scale_fmt
        if self.modules_to_not_convert:
            out["modules_to_not_convert"] = list(self.modules_to_not_convert)
        return out

    def converts(self, module: str) -> bool:
        """Whether the linear layer named ``module`` (HF name, e.g.
        ``model.layers.0.self_attn.q_a_proj``) is FP8: not in :data:`ALWAYS_BF16` (by its last name
        piece) and matched by no ``modules_to_not_convert`` entry (an entry matches when its dotted
        pieces are a contiguous run of the module's: ``kv_b_proj``, ``self_attn.o_proj``,
        ``model.layers.0``; ``gate`` does not match ``gate_proj``)."""
        pieces = module.split(".")
        if pieces[-1] in ALWAYS_BF16:
            return False
        for entry in self.modules_to_not_convert:
            run = entry.split(".")
            if any(pieces[i:i + len(run)] == run for i in range(len(pieces) - len(run) + 1)):
                return False
        return True
