"""Conversion of a model built with bf16 layers to the FP8 block-scaled ones its quantization
config names (before any weight is loaded or initialised).
"""

from __future__ import annotations

from torch import nn

from dsaspec.configs.quantization import Fp8Quantization
from dsaspec.layers.fp8_linear import Fp8Linear
from dsaspec.layers.linear import Linear
from dsaspec.layers.moe import RoutedExperts


def convert_to_fp8(root: nn.Module, quant: Fp8Quantization, device=None) -> list[str]:
    """Replace every :class:`~dsaspec.layers.linear.Linear` of ``root`` that ``quant`` converts
    (by its name under ``root``: HF names when ``root`` is the model) with an :class:`Fp8Linear` of
    the same shape and split on ``device``, and every
    :class:`~dsaspec.layers.moe.RoutedExperts` it converts (``...mlp.experts``) with FP8 experts.
    Returns the converted names."""
    converted = []
    for name, module in list(root.named_modules()):
        if isinstance(module, Linear) and quant.converts(name):
            replacement = Fp8Linear.like(module, name, quant.scale_fmt, device)
        elif isinstance(module, RoutedExperts) and not module.fp8 and quant.converts(name):
            replacement = module.to_fp8(name, quant.scale_fmt, device)
        else:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(root.get_submodule(parent), attr, replacement)
        converted.append(name)
    return converted
