"""Safetensors checkpoints with the HF tensor names (``model.layers.0.self_attn.q_a_proj.weight``,
``model.layers.0.self_attn.indexer.wq_b.weight``, the MTP layer as ``model.layers.{L}.enorm`` /
``hnorm`` / ``eh_proj`` / ``shared_head.norm`` / its decoder-layer tensors, ``lm_head.weight``). The
MoE layers' routed experts are read from per-expert tensors (``mlp.experts.{e}.gate_proj.weight``,
``up_proj``, ``down_proj``: the official checkpoints and transformers' ``save_pretrained``) or from
transformers' fused ``mlp.experts.gate_up_proj`` / ``down_proj``, whichever a layer has, into the
model's fused ``w13`` / ``w2``; they are written per expert.

A checkpoint is a directory: ``config.json`` (HF fields) and either ``model.safetensors`` or shards
listed in ``model.safetensors.index.json`` (``weight_map``: tensor name -> file). Problems with the
checkpoint (missing or malformed files, tensors that do not match the model) raise
:class:`~dsaspec.errors.UserError` naming the file. A tensor-parallel rank reads only its slices of
the sharded tensors (``safe_open(...).get_slice``), from the same checkpoint as TP 1.

FP8 checkpoints (``quantization_config`` fp8 / e4m3 / [128, 128]) store each quantized projection
as ``X.weight`` (F8_E4M3) and ``X.weight_scale_inv`` (F32, one per 128 x 128 block); they are
loaded as stored into :class:`~dsaspec.layers.fp8_linear.Fp8Linear`, the routed experts'
per-expert ``gate_proj`` / ``up_proj`` / ``down_proj`` weights and scales into the FP8
:class:`~dsaspec.layers.moe.RoutedExperts` (``w13`` / ``w2`` e4m3, ``w13_scale_inv`` /
``w2_scale_inv``), and every tensor's dtype is checked against what the config declares.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dsaspec.errors import UserError
from dsaspec.configs.model_config import ModelConfig, check_implemented
from dsaspec.models.dsa_model import DSAModel

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = ".weight_scale_inv"
FP8_DTYPE = "F8_E4M3"
_FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")


class CheckpointNotFoundError(UserError, FileNotFoundError):
    """A checkpoint directory or one of its files does not exist."""


def _shared_duplicates(config: ModelConfig) -> re.Pattern:
    # DeepSeek checkpoints repeat the shared embedding / LM head inside the MTP layer.
    layer = config.num_hidden_layers
    return re.compile(rf"model\.layers\.{layer}\.(embed_tokens\.weight|shared_head\.head\.weight)")


def save_checkpoint(model: DSAModel, path: str | Path, *, max_shard_bytes: int | None = None) -> Path:
    """Write ``config.json`` and the parameters (HF names, their own dtype) under directory
    ``path``: one ``model.safetensors``, or shards of at most ``max_shard_bytes`` (a tensor larger
    than that gets a shard of its own) plus ``model.safetensors.index.json``. Returns ``path``.
    Only a TP 1 model (a rank holds only its shards)."""
    if model.tp_size != 1:
        raise ValueError(f"save_checkpoint writes a TP 1 model; this one is rank {model.group.rank} of TP "
                         f"{model.tp_size}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(model.config.to_hf_dict(), indent=2, sort_keys=True))
    parts = model.checkpoint_parts()
    tensors = {}
    for name, param in model.state_dict().items():
        if name in parts:   # TP 1: each part is a whole per-expert tensor
            tensors.update((part.name, part.target.detach().cpu().clone()) for part in parts[name])
        else:
            tensors[name] = param.detach().contiguous().cpu()
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


def _read_json(file: Path):
    try:
        return json.loads(file.read_text())
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise UserError(f"{file}: not valid JSON ({err})") from None


@contextlib.contextmanager
def _open_safetensors(file: Path):
    """``safe_open`` that names ``file`` when it is missing or not a valid safetensors file."""
    if not file.is_file():
        raise CheckpointNotFoundError(f"{file}: no such file (listed in {INDEX_FILE})")
    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except SafetensorError as err:
        raise UserError(f"{file}: not a valid safetensors file ({err})") from None


def load_config(path: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of checkpoint directory ``path`` (its ``config.json``). Raises
    ``UserError`` naming the file for a bad config (an unknown ``quantization_config`` included)
    or one claiming what is not implemented (FP8 experts off the 128 x 128 blocks:
    :func:`~dsaspec.configs.model_config.check_implemented`)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointNotFoundError(f"checkpoint directory {path} does not exist or is not a directory")
    file = path / CONFIG_FILE
    if not file.is_file():
        raise CheckpointNotFoundError(f"no {CONFIG_FILE} in checkpoint directory {path}")
    hf = _read_json(file)
    try:
        config = ModelConfig.from_hf_dict(hf, name=path.name)
        check_implemented(hf)
        return config
    except ValueError as err:  # a missing key, a bad value or what is not implemented, named by the check
        raise UserError(f"{file}: {err}") from None


def _weight_files(path: Path) -> dict[str, str]:
    """Tensor name -> file, from the index or the single file."""
    if (path / INDEX_FILE).is_file():
        weight_map = _read_json(path / INDEX_FILE)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise UserError(f"{path / INDEX_FILE}: expected a 'weight_map' object (tensor name -> file)")
        return dict(weight_map)
    if (path / SINGLE_FILE).is_file():
        with _open_safetensors(path / SINGLE_FILE) as f:
            return {name: SINGLE_FILE for name in f.keys()}
    raise CheckpointNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in checkpoint directory {path}")


def _bf16_reason(model: DSAModel) -> str:
    if model.config.quantization is None:
        return "its config has no quantization_config"
    return "it is one of the modules kept unquantized (ALWAYS_BF16 or quantization_config.modules_to_not_convert)"


def _held_dtypes(model: DSAModel, parts: dict) -> dict[str, torch.dtype]:
    """The dtype the model holds each checkpoint tensor in: the parameters', the experts' parts'."""
    held = {name: p.dtype for name, p in model.state_dict().items() if name not in parts}
    held.update((part.name, part.target.dtype) for group in parts.values() for part in group)
    return held


def _check_fp8_pairs(held: dict[str, torch.dtype], files: dict[str, str], path: Path, model: DSAModel) -> None:
    """Every FP8 weight of the model (a projection's or an expert's) has its scale in the
    checkpoint and every scale in the checkpoint belongs to an FP8 weight of the model."""
    fp8 = {name for name, dtype in held.items() if dtype == torch.float8_e4m3fn}
    for weight in sorted(fp8):
        scale = weight[: -len(".weight")] + SCALE_SUFFIX
        if weight in files and scale not in files:
            raise UserError(f"{path / files[weight]}: FP8 weight {weight} has no {scale} (the config's "
                            "quantization_config declares it FP8 with one fp32 scale per 128 x 128 block)")
    for scale in sorted(n for n in files if n.endswith(SCALE_SUFFIX)):
        weight = scale[: -len(SCALE_SUFFIX)] + ".weight"
        if weight not in files:
            raise UserError(f"{path / files[scale]}: scale {scale} has no weight {weight}")
        if weight not in fp8 and weight in held:
            raise UserError(f"{path / files[scale]}: {weight} is stored FP8 (it has {scale}), but the model "
                            f"holds it in {held[weight]}: {_bf16_reason(model)}")


def _check_dtype(param: torch.dtype, name: str, dtype: str, file: Path) -> None:
    """The checkpoint dtype of tensor ``name`` against the dtype ``param`` the model holds it in."""
    if param == torch.float8_e4m3fn and dtype != FP8_DTYPE:
        raise UserError(f"{file}: tensor {name} is {dtype}, but the config's quantization_config declares it "
                        f"FP8: expected {FP8_DTYPE}")
    if name.endswith(SCALE_SUFFIX) and dtype != "F32":
        raise UserError(f"{file}: scale {name} is {dtype}, expected F32")
    if param != torch.float8_e4m3fn and dtype not in _FLOAT_DTYPES:
        raise UserError(f"{file}: tensor {name} is {dtype}; the model holds it in {param} "
                        f"(expected one of {list(_FLOAT_DTYPES)})")


def _check_values(name: str, tensor: torch.Tensor, file: Path) -> None:
    """FP8 codes hold no NaN; block scales are finite and positive."""
    if tensor.dtype == torch.float8_e4m3fn and ((tensor.view(torch.uint8) & 0x7F) == 0x7F).any():
        raise UserError(f"{file}: FP8 weight {name} holds NaN codes")
    if name.endswith(SCALE_SUFFIX) and not (torch.isfinite(tensor) & (tensor > 0)).all():
        raise UserError(f"{file}: scale {name} holds values that are not finite and positive")


def _expert_parts(model: DSAModel, files: dict[str, str]) -> dict:
    """The fused expert parameters' parts in the layout the checkpoint has, per parameter:
    transformers' fused tensors where all of them are present (bf16 experts), else the per-expert
    tensors (FP8 experts: always, the official layout)."""
    fused = model.checkpoint_parts(fused=True)
    return {name: fused[name] if name in fused and parts[0].target.dtype != torch.float8_e4m3fn
            and all(p.name in files for p in fused[name]) else parts
            for name, parts in model.checkpoint_parts().items()}


@torch.no_grad()
def load_weights(model: DSAModel, path: str | Path) -> DSAModel:
    """Copy every parameter of ``model`` from checkpoint directory ``path`` (cast to the
    parameter's dtype; bit-exact when the dtypes match). A TP rank reads only its slice of each
    sharded tensor (``model.shards()``, the experts' parts; vocab padding zero). FP8 weights and
    their scales are copied as stored; experts come from per-expert or transformers' fused tensors,
    whichever the checkpoint has. Raises ``UserError`` (a ``ValueError``) naming the tensor and the
    file for an FP8 weight (a projection's or an expert's) without its ``weight_scale_inv``, a scale
    without its weight or for a module the model holds in bf16, a dtype that is not what the config
    declares (a bf16 tensor where FP8 is declared, an FP8 one where it is not, a scale not F32),
    block scales that are not finite and positive; and listing missing tensors (e.g. experts of a
    config that claims MoE over dense tensors), unexpected ones (experts of a config that says dense, ...), shapes that differ
    from the unsharded model's and unreadable files. Nothing is copied unless these checks pass,
    except the check for NaN codes in FP8 weights, made as each weight is copied. Returns ``model``."""
    path = Path(path)
    files = _weight_files(path)
    params = dict(model.state_dict())
    parts = _expert_parts(model, files)
    expected = {name: shape for name, shape in model.checkpoint_shapes().items() if name in params}
    expected.update((part.name, part.full_shape) for group in parts.values() for part in group)
    held = _held_dtypes(model, parts)
    shards = model.shards()
    duplicates = _shared_duplicates(model.config)
    _check_fp8_pairs(held, files, path, model)
    missing = sorted(set(expected) - set(files))
    unexpected = sorted(n for n in set(files) - set(expected) if not duplicates.fullmatch(n))
    if missing or unexpected:
        raise UserError(f"checkpoint {path} does not match the model: missing {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''} ({len(missing)}), unexpected "
                         f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)})")
    by_file: dict[str, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    for file, names in by_file.items():
        with _open_safetensors(path / file) as f:
            for name in names:
                tensor = f.get_slice(name)
                shape = tuple(tensor.get_shape())
                if shape != expected[name]:
                    raise UserError(f"{path / file}: tensor {name} has shape {shape}, the model expects "
                                    f"{expected[name]}")
                _check_dtype(held[name], name, tensor.get_dtype(), path / file)
                if name.endswith(SCALE_SUFFIX):
                    _check_values(name, f.get_tensor(name), path / file)
    targets: dict[str, list] = {}
    for group in parts.values():
        for part in group:
            targets.setdefault(part.name, []).append(part)
    for file, names in by_file.items():
        with _open_safetensors(path / file) as f:
            for name in names:
                if name in targets:
                    for part in targets[name]:
                        value = f.get_slice(name)[part.index]
                        if value.dtype == torch.float8_e4m3fn:
                            _check_values(name, value, path / file)
                        part.target.copy_(value)
                    continue
                shard = shards.get(name)
                part = f.get_tensor(name) if shard is None else f.get_slice(name)[shard.index(len(expected[name]))]
                if part.dtype == torch.float8_e4m3fn:
                    _check_values(name, part, path / file)
                if shard is None:
                    params[name].copy_(part)
                else:
                    shard.fill(params[name], part)
    return model


def load_checkpoint(path: str | Path, *, device=None, dtype=torch.bfloat16, use_triton: bool = False,
                    tp_group=None) -> DSAModel:
    """Build a :class:`DSAModel` (this rank's shard over ``tp_group``, or TP 1 on ``device``) from
    ``config.json`` and load its weights from ``path``."""
    model = DSAModel(load_config(path), device=device, dtype=dtype, use_triton=use_triton, tp_group=tp_group)
    return load_weights(model, path)
