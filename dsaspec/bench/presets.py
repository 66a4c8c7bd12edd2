"""The benchmarks' model choice: ``--preset`` and ``--layers`` (a preset cut to its first layers)."""

from __future__ import annotations

import argparse

from dsaspec.cli_parsing import positive_int
from dsaspec.configs.model_config import PRESETS, ModelConfig, get_config
from dsaspec.errors import UserError


def add_preset_arguments(p: argparse.ArgumentParser, default: str) -> None:
    """``--preset`` (default ``default``) and ``--layers`` on ``p``."""
    p.add_argument("--preset", default=default, choices=sorted(PRESETS), help="model preset (random weights)")
    p.add_argument("--layers", type=positive_int, default=None,
                   help="the preset cut to its first LAYERS layers (at most its own): for a preset too large "
                        "for the GPU, e.g. a rank preset on an 80 GB H100 (default: all)")


def preset_config(args: argparse.Namespace) -> ModelConfig:
    """The ``args.preset`` config, cut to its first ``args.layers`` layers where not None; raises
    :class:`~dsaspec.errors.UserError` for more layers than the preset has or a cut config that is
    not valid (a MoE preset without a MoE layer)."""
    config = get_config(args.preset)
    if args.layers is None:
        return config
    if args.layers > config.num_hidden_layers:
        raise UserError(f"--layers {args.layers}: the {args.preset} preset has {config.num_hidden_layers} layers")
    try:
        return config.replace(num_hidden_layers=args.layers)
    except ValueError as error:   # e.g. a MoE preset cut before its first MoE layer
        raise UserError(f"--layers {args.layers}: {error}") from None
