"""Safetensors checkpoints with HF names: bit-exact round trips, sharding, clear refusals."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsaspec.configs.model_config import get_config
from dsaspec.models.loader import (INDEX_FILE, SINGLE_FILE, load_checkpoint, load_config,
                                    load_weights, save_checkpoint)
from dsaspec.models.dsa_model import DSAModel


def _model(seed=0, dtype=torch.bfloat16, preset="tiny", **overrides):
    return DSAModel(get_config(preset, **overrides), dtype=dtype).init_weights(seed)


def _assert_same(a: DSAModel, b: DSAModel):
    assert a.config == b.config
    for (name, pa), (name_b, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert name == name_b and pa.dtype == pb.dtype and torch.equal(pa, pb), name


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_is_bit_exact(tmp_path, dtype, preset):
    model = _model(dtype=dtype, preset=preset, indexer_rope_interleave=False)
    save_checkpoint(model, tmp_path)
    assert (tmp_path / SINGLE_FILE).is_file()
    assert "model.layers.2.shared_head.norm.weight" in load_file(str(tmp_path / SINGLE_FILE))
    _assert_same(model, load_checkpoint(tmp_path, dtype=dtype))


def test_sharded_round_trip(tmp_path):
    model = _model(seed=1)
    save_checkpoint(model, tmp_path, max_shard_bytes=1 << 20)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tmp_path / SINGLE_FILE).exists()
    _assert_same(model, load_weights(_model(seed=2), tmp_path))


def test_config_json_reads_back_and_declares_every_layer_dense(tmp_path):
    config = get_config("tiny", index_topk=32, indexer_rope_interleave=False)
    save_checkpoint(DSAModel(config, dtype=torch.bfloat16).init_weights(0), tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["first_k_dense_replace"] == hf["num_hidden_layers"]  # an HF reader builds no MoE layer
    assert load_config(tmp_path) == config


def test_shared_mtp_duplicates_are_accepted(tmp_path):
    """DeepSeek checkpoints repeat embed_tokens / shared_head.head under the MTP layer."""
    model = _model()
    save_checkpoint(model, tmp_path)
    tensors = load_file(str(tmp_path / SINGLE_FILE))
    tensors["model.layers.2.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.2.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(tmp_path / SINGLE_FILE))
    _assert_same(model, load_weights(_model(seed=3), tmp_path))


def test_missing_unexpected_and_misshapen_tensors_are_refused_without_copying(tmp_path):
    model = _model()
    save_checkpoint(model, tmp_path)
    tensors = load_file(str(tmp_path / SINGLE_FILE))
    target = _model(seed=4)
    before = {k: v.clone() for k, v in target.state_dict().items()}

    broken = dict(tensors)
    del broken["model.layers.0.self_attn.indexer.wk.weight"]
    broken["model.layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(2, 2)
    save_file(broken, str(tmp_path / SINGLE_FILE))
    with pytest.raises(ValueError, match=r"missing \['model.layers.0.self_attn.indexer.wk.weight'\].*"
                                         r"unexpected \['model.layers.0.mlp.experts.0.up_proj.weight'\]"):
        load_weights(target, tmp_path)

    misshapen = dict(tensors)
    misshapen["model.norm.weight"] = torch.ones(128, dtype=torch.bfloat16)
    save_file(misshapen, str(tmp_path / SINGLE_FILE))
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(128,\), the model expects \(256,\)"):
        load_weights(target, tmp_path)
    for name, value in target.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(get_config("tiny").to_hf_dict()))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_checkpoint(tmp_path)


def test_index_share_checkpoint_has_no_indexer_weights_for_shared_layers(tmp_path):
    """GLM-5.2 IndexShare: shared layers carry no indexer tensors; the config's indexer_types and
    index_share_for_mtp_iteration survive the round trip, and a config that calls a shared layer
    full is refused: the checkpoint has no indexer tensors for it."""
    config = get_config("tiny", num_hidden_layers=3, indexer_types=("full", "shared", "full"),
                        index_share_for_mtp_iteration=True)
    model = DSAModel(config, dtype=torch.float32).init_weights(5)
    path = save_checkpoint(model, tmp_path / "ckpt")
    names = load_file(str(path / SINGLE_FILE)).keys()
    assert not any(n.startswith("model.layers.1.self_attn.indexer.") for n in names)
    assert any(n.startswith("model.layers.2.self_attn.indexer.") for n in names)
    assert any(n.startswith("model.layers.3.self_attn.indexer.") for n in names)       # the MTP layer
    loaded = load_checkpoint(path, dtype=torch.float32)
    assert loaded.config == config
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    hf = json.loads((path / "config.json").read_text())
    hf["indexer_types"] = ["full"] * 3
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"missing \['model\.layers\.1\.self_attn\.indexer"):
        load_checkpoint(path, dtype=torch.float32)


def test_indexer_types_from_frequency_and_offset():
    from dsaspec.configs.model_config import ModelConfig

    hf = get_config("tiny", num_hidden_layers=8).to_hf_dict()
    hf.update(index_topk_freq=4, index_skip_topk_offset=3)
    config = ModelConfig.from_hf_dict(hf)
    assert [config.has_indexer(i) for i in range(9)] == [True, True, True, False, False, False, True, False, True]
    hf.pop("index_skip_topk_offset")
    with pytest.raises(ValueError, match="index_topk_freq > 1 without index_skip_topk_offset"):
        ModelConfig.from_hf_dict(hf)


def test_moe_round_trip_per_expert_and_fused_tensors(tmp_path):
    """tiny-moe: the experts are written per expert (the official layout; layer 1 and the MTP layer 2)
    and read back bit-exact; expert e's gate and up rows land in ``w13[e]`` (gate first) and its down
    projection in ``w2[e]``; a checkpoint with transformers' fused tensors loads to the same model."""
    model = _model(preset="tiny-moe", dtype=torch.float32, seed=6)
    save_checkpoint(model, tmp_path / "split")
    tensors = load_file(str(tmp_path / "split" / SINGLE_FILE))
    for layer in (1, 2):
        prefix = f"model.layers.{layer}.mlp."
        assert tensors[prefix + "experts.7.gate_proj.weight"].shape == (128, 256)
        assert tensors[prefix + "experts.7.down_proj.weight"].shape == (256, 128)
        assert {prefix + "gate.weight", prefix + "gate.e_score_correction_bias",
                prefix + "shared_experts.up_proj.weight"} <= tensors.keys()
    assert not any("w13" in name or "w2" in name for name in tensors)
    assert "model.layers.0.mlp.gate_proj.weight" in tensors                       # first_k_dense_replace = 1
    _assert_same(model, load_checkpoint(tmp_path / "split", dtype=torch.float32))

    generator = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if ".experts." in n]:    # fresh expert tensors, independent of init
        tensors[name] = torch.randn(tensors[name].shape, generator=generator)
    save_file(tensors, str(tmp_path / "split" / SINGLE_FILE))
    split = load_checkpoint(tmp_path / "split", dtype=torch.float32)
    experts = model.config.n_routed_experts
    fused = dict(tensors)
    for layer in (1, 2):
        prefix = f"model.layers.{layer}.mlp.experts."
        gate_up = [torch.cat((fused.pop(f"{prefix}{e}.gate_proj.weight"), fused.pop(f"{prefix}{e}.up_proj.weight")))
                   for e in range(experts)]
        fused[prefix + "gate_up_proj"] = torch.stack(gate_up)
        fused[prefix + "down_proj"] = torch.stack([fused.pop(f"{prefix}{e}.down_proj.weight") for e in range(experts)])
        loaded = split.model.layers[layer].mlp.experts
        assert torch.equal(loaded.w13, fused[prefix + "gate_up_proj"])
        assert torch.equal(loaded.w2, fused[prefix + "down_proj"])
    (tmp_path / "fused").mkdir()
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "split" / "config.json").read_text())
    save_file(fused, str(tmp_path / "fused" / SINGLE_FILE))
    _assert_same(split, load_checkpoint(tmp_path / "fused", dtype=torch.float32))
    del fused["model.layers.2.mlp.experts.down_proj"]
    save_file(fused, str(tmp_path / "fused" / SINGLE_FILE))
    with pytest.raises(ValueError, match=r"missing \['model.layers.2.mlp.experts.0.down_proj.weight'.*"
                                         r"down_proj.weight'\] \(8\), unexpected \[\]"):
        load_checkpoint(tmp_path / "fused", dtype=torch.float32)
