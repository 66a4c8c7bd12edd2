"""Safetensors checkpoints with the HF tensor names (``model.layers.0.self_attn.q_a_proj.weight``,
``model.layers.0.self_attn.indexer.wq_b.weight``, the MTP layer as ``model.layers.{L}.enorm`` /
``hnorm`` / ``eh_proj`` / ``shared_head.norm`` / its decoder-layer tensors, ``lm_head.weight``).

A checkpoint is a directory: ``config.json`` (HF fields) and either ``model.safetensors`` or shards
listed in ``model.safetensors.index.json`` (``weight_map``: tensor name -> file).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsaspec.runtime.config import ModelConfig
from dsaspec.runtime.model import DSAModel

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _shared_duplicates(config: ModelConfig) -> re.Pattern:
    # DeepSeek checkpoints repeat the shared embedding / LM head inside the MTP layer.
    layer = config.num_hidden_layers
    return re.compile(rf"model\.layers\.{layer}\.(embed_tokens\.weight|shared_head\.head\.weight)")


def save_checkpoint(model: DSAModel, path: str | Path, *, max_shard_bytes: int | None = None) -> Path:
    """Write ``config.json`` and the parameters (HF names, their own dtype) under directory
    ``path``: one ``model.safetensors``, or shards of at most ``max_shard_bytes`` (a tensor larger
    than that gets a shard of its own) plus ``model.safetensors.index.json``. Returns ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(model.config.to_hf_dict(), indent=2, sort_keys=True))
    tensors = {name: param.detach().contiguous().cpu() for name, param in model.state_dict().items()}
    if max_shard_bytes is None:
        save_file(tensors, str(path / SINGLE_FILE), metadata={"format": "pt"})
        return path
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
    return path


def load_config(path: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of checkpoint directory ``path`` (its ``config.json``)."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in checkpoint directory {path}")
    return ModelConfig.from_hf_dict(json.loads(file.read_text()), name=Path(path).name)


def _weight_files(path: Path) -> dict[str, str]:
    """Tensor name -> file, from the index or the single file."""
    if (path / INDEX_FILE).is_file():
        return dict(json.loads((path / INDEX_FILE).read_text())["weight_map"])
    if (path / SINGLE_FILE).is_file():
        with safe_open(str(path / SINGLE_FILE), framework="pt") as f:
            return {name: SINGLE_FILE for name in f.keys()}
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in checkpoint directory {path}")


@torch.no_grad()
def load_weights(model: DSAModel, path: str | Path) -> DSAModel:
    """Copy every parameter of ``model`` from checkpoint directory ``path`` (cast to the
    parameter's dtype; bit-exact when the dtypes match). Raises ``ValueError`` listing missing
    tensors, unexpected ones (MoE experts, fp8 scales, ... are not part of this model) and shape
    mismatches; nothing is copied unless all checks pass. Returns ``model``."""
    path = Path(path)
    files = _weight_files(path)
    params = dict(model.state_dict())
    duplicates = _shared_duplicates(model.config)
    missing = sorted(set(params) - set(files))
    unexpected = sorted(n for n in set(files) - set(params) if not duplicates.fullmatch(n))
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the model: missing {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''} ({len(missing)}), unexpected "
                         f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)})")
    by_file: dict[str, list[str]] = {}
    for name in params:
        by_file.setdefault(files[name], []).append(name)
    for file, names in by_file.items():
        with safe_open(str(path / file), framework="pt") as f:
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(params[name].shape):
                    raise ValueError(f"checkpoint tensor {name} has shape {shape}, the model expects "
                                     f"{tuple(params[name].shape)}")
    for file, names in by_file.items():
        with safe_open(str(path / file), framework="pt") as f:
            for name in names:
                params[name].copy_(f.get_tensor(name))
    return model


def load_checkpoint(path: str | Path, *, device=None, dtype=torch.bfloat16, use_triton: bool = False) -> DSAModel:
    """Build a :class:`DSAModel` from ``config.json`` and load its weights from ``path``."""
    model = DSAModel(load_config(path), device=device, dtype=dtype, use_triton=use_triton)
    return load_weights(model, path)
