"""ModelConfig: the presets are the released configs, validate and round-trip through HF dicts; the
derived widths are the model's; bad values give clear errors."""

import json
import math
import re

import pytest
import torch

from dsaspec.bench import e2e
from dsaspec.cli_parsing import defaults_of
from dsaspec.configs.model_config import (DENSE_FFN, PRESETS, ModelConfig, check_implemented, get_config,
                                          tp_rank_config)
from dsaspec.configs.quantization import Fp8Quantization
from dsaspec.layers.fp8_convert import convert_to_fp8
from dsaspec.layers.moe import RoutedExperts
from dsaspec.layers.vocab_parallel import padded_vocab_size
from dsaspec.memory import PAGE_SIZE, KVPool, ReqToTokenPool
from dsaspec.models.dsa_model import DSAModel
from fake_tp import fake_groups

# The released config.json files (zai-org/GLM-5, deepseek-ai/DeepSeek-V3.2), MoE and token fields
# kept: the MoE presets must be what they say, and the fields this runtime does not model are ignored.
GLM5_CONFIG_JSON = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
    "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
    "moe_intermediate_size": 2048, "num_hidden_layers": 78, "num_attention_heads": 64,
    "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
    "v_head_dim": 256, "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048,
    "n_routed_experts": 256, "first_k_dense_replace": 3, "rms_norm_eps": 1e-5,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "max_position_embeddings": 202752, "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
}
DEEPSEEK_V32_CONFIG_JSON = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048,
    "n_routed_experts": 256, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_layer_freq": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "rms_norm_eps": 1e-6, "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_validate_and_round_trip_through_hf_dict(name):
    config = get_config(name)
    assert config.validate() is config
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(config.to_hf_dict()))) == config


@pytest.mark.parametrize("name,published", [("glm5-moe", GLM5_CONFIG_JSON),
                                            ("deepseek-v32-moe", DEEPSEEK_V32_CONFIG_JSON)])
def test_presets_are_the_released_configs(name, published):
    config = ModelConfig.from_hf_dict(published)
    assert config == get_config(name)
    layers = config.num_hidden_layers
    assert [config.is_moe_layer(i) for i in range(layers + 1)] == [False] * 3 + [True] * (layers - 2)
    dense = get_config(name.split("-")[0] if name == "glm5-moe" else "deepseek_v32")
    assert dense == config.replace(**DENSE_FFN) and not dense.is_moe_layer(layers)


def test_bench_keeps_glm5_attention_and_vocab():
    glm, bench = get_config("glm5"), get_config("bench")
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "q_lora_rank", "qk_nope_head_dim",
                "v_head_dim", "index_n_heads", "index_topk", "indexer_rope_interleave"):
        assert getattr(bench, key) == getattr(glm, key), key
    assert bench.num_hidden_layers == 2


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_derived_widths_are_the_models_widths(name):
    # Built on the meta device: the shapes of the full-size models without their memory.
    config = get_config(name)
    try:
        check_implemented(config.to_hf_dict())
    except ValueError as refusal:        # FP8 routed experts: the model refuses to build, with the same words
        with pytest.raises(ValueError, match=re.escape(str(refusal))):
            DSAModel(config, device="meta")
        return
    model = DSAModel(config, device="meta")
    attn = model.model.layers[0].self_attn
    assert attn.q_b_proj.out_features == config.num_attention_heads * config.qk_head_dim
    assert attn.kv_a_proj_with_mqa.out_features == config.kv_cache_dim
    assert KVPool.for_model(config, 1, device="meta").mla_cache[0].shape == (1, config.kv_cache_dim)


def test_softmax_scale_without_and_with_yarn():
    # 1/sqrt(qk_head_dim) unless YaRN sets mscale_all_dim; then it grows with the factor.
    config = get_config("tiny")
    plain = config.qk_head_dim ** -0.5
    assert config.softmax_scale == plain

    def yarn(**fields):
        scaling = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 32} | fields
        return config.replace(rope_scaling=scaling).softmax_scale

    assert yarn() == yarn(mscale_all_dim=0.0) == yarn(factor=1.0, mscale_all_dim=1.0) == plain
    assert plain < yarn(factor=4.0, mscale_all_dim=1.0) < yarn(mscale_all_dim=1.0) < yarn(mscale_all_dim=2.0)


def test_from_hf_dict_picks_the_indexer_layout_by_model_type():
    assert ModelConfig.from_hf_dict(GLM5_CONFIG_JSON).indexer_rope_interleave is True
    deepseek = dict(GLM5_CONFIG_JSON, model_type="deepseek_v32")
    assert ModelConfig.from_hf_dict(deepseek).indexer_rope_interleave is False
    explicit = dict(GLM5_CONFIG_JSON, indexer_rope_interleave=False)
    assert ModelConfig.from_hf_dict(explicit).indexer_rope_interleave is False


@pytest.mark.parametrize("change, message", [
    ({"kv_lora_rank": 256}, r"kv_lora_rank=512 and qk_rope_head_dim=64 \(a 576-wide cache\), got kv_lora_rank=256"),
    ({"qk_rope_head_dim": 32}, r"got kv_lora_rank=512, qk_rope_head_dim=32"),
    ({"index_head_dim": 64}, r"index_head_dim must be 128 \(the indexer kernel's head dim\), got 64"),
    ({"hidden_size": 0}, "ModelConfig.hidden_size must be a positive int, got 0"),
    ({"num_attention_heads": 2.5}, "ModelConfig.num_attention_heads must be a positive int, got 2.5"),
    ({"index_topk": True}, "ModelConfig.index_topk must be a positive int, got True"),
    ({"num_nextn_predict_layers": 2}, r"num_nextn_predict_layers must be 0 or 1 \(one MTP layer\), got 2"),
    ({"indexer_rope_interleave": "yes"}, "ModelConfig.indexer_rope_interleave must be a bool, got 'yes'"),
    ({"rms_norm_eps": 0.0}, "ModelConfig.rms_norm_eps must be a positive number, got 0.0"),
    ({"tie_word_embeddings": True}, "ModelConfig.tie_word_embeddings=True is not supported"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "only YaRN is supported, got type 'linear'"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}},
     "ModelConfig.rope_scaling needs 'original_max_position_embeddings' for YaRN"),
])
def test_validate_names_the_bad_field(change, message):
    with pytest.raises(ValueError, match=message):
        get_config("tiny", **change)


def test_from_hf_dict_names_missing_keys():
    hf = dict(GLM5_CONFIG_JSON)
    del hf["q_lora_rank"], hf["index_topk"]
    with pytest.raises(ValueError, match=r"missing required key\(s\) \['q_lora_rank', 'index_topk'\]"):
        ModelConfig.from_hf_dict(hf)
    with pytest.raises(ValueError, match="from_hf_dict expects a dict, got list"):
        ModelConfig.from_hf_dict([("hidden_size", 1)])


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown model preset 'glm6'"):
        get_config("glm6")


def test_check_implemented_refuses_fp8_experts_off_the_blocks():
    dense = get_config("tiny").to_hf_dict()
    check_implemented(dense)
    check_implemented(GLM5_CONFIG_JSON)
    check_implemented(dense | {"quantization_config": None})
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    check_implemented(dense | {"quantization_config": fp8})                 # dense FP8 weights load
    moe = dense | {"n_routed_experts": 8, "moe_intermediate_size": 64, "mlp_layer_types": ["sparse"]}
    check_implemented(moe)                                                    # bf16 experts load
    check_implemented(moe | {"moe_intermediate_size": 256, "quantization_config": fp8})  # FP8 experts load
    with pytest.raises(ValueError, match=r"moe_intermediate_size = 64: FP8 routed experts \(quantization_config "
                                         r"with 8 routed experts\) need a multiple of 128"):
        check_implemented(moe | {"quantization_config": fp8})


def test_moe_layers_from_hf_keys():
    """Which layers are MoE: mlp_layer_types when given (transformers' rule), else
    first_k_dense_replace (HF default 3) and moe_layer_freq (DeepSeek's rule); the MTP layer is MoE
    in an MoE model; a config whose decoder layers are all dense reads as the dense model."""
    dense = get_config("tiny", num_hidden_layers=8).to_hf_dict()
    assert dense["mlp_layer_types"] == ["dense"] * 8 and dense["n_routed_experts"] == 0
    moe = {k: v for k, v in dense.items() if k not in ("mlp_layer_types", "first_k_dense_replace")}
    moe |= {"n_routed_experts": 8, "moe_intermediate_size": 64, "num_experts_per_tok": 2}

    def kinds(hf):
        config = ModelConfig.from_hf_dict(hf)
        return "".join("M" if config.is_moe_layer(i) else "d" for i in range(9))

    assert kinds(moe) == "dddMMMMMM"                                       # HF's default first 3 dense
    assert kinds(moe | {"first_k_dense_replace": 1, "moe_layer_freq": 2}) == "ddMdMdMdM"
    assert kinds(moe | {"num_local_experts": 8, "n_routed_experts": None, "first_k_dense_replace": 6}) == "ddddddMMM"
    assert kinds(moe | {"mlp_layer_types": ["dense", "sparse"] * 4}) == "dMdMdMdMM"
    for hf in (moe | {"first_k_dense_replace": 8}, moe | {"n_routed_experts": 0}, moe | {"mlp_layer_types": ["dense"] * 8}):
        assert ModelConfig.from_hf_dict(hf) == get_config("tiny", num_hidden_layers=8)
    config = ModelConfig.from_hf_dict(moe | {"first_k_dense_replace": 1, "moe_layer_freq": 2})
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(config.to_hf_dict()))) == config
    assert config.to_hf_dict()["mlp_layer_types"] == ["dense"] + ["dense", "sparse"] * 3 + ["dense"]
    defaults = ModelConfig.from_hf_dict({k: v for k, v in moe.items() if k != "num_experts_per_tok"}
                                        | {"model_type": "deepseek_v32", "n_routed_experts": 16})
    assert (defaults.num_experts_per_tok, defaults.n_shared_experts, defaults.n_group, defaults.topk_group,
            defaults.routed_scaling_factor, defaults.norm_topk_prob) == (8, 1, 8, 4, 2.5, True)
    with pytest.raises(ValueError, match="first_k_dense_replace must be an int >= 0, got '3'"):
        ModelConfig.from_hf_dict(moe | {"first_k_dense_replace": "3"})
    with pytest.raises(ValueError, match="mlp_layer_types must be a list"):
        ModelConfig.from_hf_dict(moe | {"mlp_layer_types": "dense"})


@pytest.mark.parametrize("change, message", [
    ({"topk_method": "greedy"}, "topk_method: only 'noaux_tc'.*got 'greedy'"),
    ({"scoring_func": "softmax"}, "scoring_func: only 'sigmoid' is implemented, got 'softmax'"),
    ({"n_group": 3}, r"n_group \(3\) must divide n_routed_experts \(8\) into groups of >= 2"),
    ({"n_group": 8, "topk_group": 1, "num_experts_per_tok": 1}, r"n_group \(8\) must divide"),
    ({"topk_group": 5}, r"topk_group \(5\) must be <= n_group \(4\)"),
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) exceeds the 4 experts of topk_group=2"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size must be an int >= 1, got 0"),
    ({"routed_scaling_factor": 0.0}, "routed_scaling_factor must be a positive number"),
    ({"norm_topk_prob": 1}, "norm_topk_prob must be a bool"),
    ({"mlp_layer_types": ("dense",)}, "mlp_layer_types must hold 2 entries"),
    ({"first_k_dense_replace": 2}, "n_routed_experts=8 but no MoE decoder layer"),
    ({"n_routed_experts": 0}, r"n_routed_experts is 0 \(every FFN dense\) but \['moe_intermediate_size'"),
])
def test_moe_validation_names_the_bad_field(change, message):
    with pytest.raises(ValueError, match=message):
        get_config("tiny-moe", **change)


FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}


def test_fp8_quantization_config_round_trips():
    dense = get_config("tiny").to_hf_dict()
    assert ModelConfig.from_hf_dict(dense | {"quantization_config": None}).quantization is None
    assert ModelConfig.from_hf_dict(dense | {"quantization_config": {}}).quantization is None
    v32 = FP8 | {"activation_scheme": "dynamic", "scale_fmt": "ue8m0"}
    config = ModelConfig.from_hf_dict(dense | {"quantization_config": v32 | {"ignored_layers": ["kv_b_proj"]}})
    assert config.quantization == Fp8Quantization(scale_fmt="ue8m0", modules_to_not_convert=("kv_b_proj",))
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    assert config != ModelConfig.from_hf_dict(dense)


@pytest.mark.parametrize("change,message", [
    ({"quant_method": "awq"}, "quant_method: only 'fp8'.*got 'awq'"),
    ({"quant_method": None}, "quant_method: only 'fp8'.*got None"),
    ({"fmt": "e5m2"}, "fmt: expected 'e4m3', got 'e5m2'"),
    ({"weight_block_size": [64, 64]}, r"weight_block_size: expected \[128, 128\].*got \[64, 64\]"),
    ({"weight_block_size": None}, "weight_block_size: expected"),
    ({"activation_scheme": "static"}, "activation_scheme: expected 'dynamic'"),
    ({"scale_fmt": "e8m0"}, "scale_fmt: expected 'ue8m0' or absent, got 'e8m0'"),
    ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert: expected a list"),
    ({"group_size": 128}, r"unknown key\(s\) \['group_size'\]"),
])
def test_bad_quantization_config_is_named(change, message):
    dense = get_config("tiny").to_hf_dict()
    with pytest.raises(ValueError, match=f"quantization_config.*{message}"):
        ModelConfig.from_hf_dict(dense | {"quantization_config": FP8 | change})
    with pytest.raises(ValueError, match="quantization_config: expected an object"):
        ModelConfig.from_hf_dict(dense | {"quantization_config": "fp8"})


def test_fp8_converts_the_projections_not_the_bf16_modules():
    q = Fp8Quantization(modules_to_not_convert=("layers.1.mlp", "kv_b_proj"))
    assert q.converts("model.layers.0.self_attn.q_a_proj")
    assert q.converts("model.layers.0.mlp.gate_proj")             # "gate" (the router) is not gate_proj
    assert q.converts("model.layers.0.self_attn.indexer.wk")
    assert not q.converts("model.layers.0.self_attn.indexer.weights_proj")
    assert not q.converts("model.layers.2.eh_proj")
    assert not q.converts("model.layers.3.mlp.gate")
    assert not q.converts("model.layers.1.mlp.up_proj")
    assert q.converts("model.layers.11.mlp.up_proj")              # pieces, not substrings
    assert Fp8Quantization(modules_to_not_convert=("up",)).converts("model.layers.0.mlp.up_proj")
    assert not q.converts("model.layers.0.self_attn.kv_b_proj")


def test_model_type_must_be_a_dsa_model():
    with pytest.raises(ValueError, match="model_type must be a DSA model type.*got 'llama'"):
        get_config("tiny").replace(model_type="llama")
    with pytest.raises(ValueError, match="got 'deepseek_v3'"):
        ModelConfig.from_hf_dict(dict(DEEPSEEK_V32_CONFIG_JSON, model_type="deepseek_v3"))


RANK_PRESETS = [("glm5-fp8-tp8-rank", "glm5-moe", Fp8Quantization()),
                ("deepseek-v32-fp8-tp8-rank", "deepseek-v32-moe", Fp8Quantization(scale_fmt="ue8m0"))]
H200_BUDGET = 130e9        # of the H200's 141 GB: the rest for activations, graphs and init_weights' fp32 draws


@pytest.mark.parametrize("name,full_name,quant", RANK_PRESETS, ids=[r[0] for r in RANK_PRESETS])
def test_tp8_rank_presets_are_one_rank_of_the_released_models(name, full_name, quant):
    """The rank preset's TP 1 model has exactly the parameter shapes of rank 0 of the released model
    at TP 8 (bf16 twins, built on meta), at full depth with its MTP layer and FP8 as declared."""
    rank, full = get_config(name), get_config(full_name)
    assert rank.quantization == quant and rank.num_hidden_layers == full.num_hidden_layers
    assert rank.num_nextn_predict_layers == 1 and rank.n_routed_experts == full.n_routed_experts == 256
    assert rank.num_attention_heads * 8 == full.num_attention_heads
    assert rank.vocab_size == padded_vocab_size(full.vocab_size, 8) // 8
    assert rank.replace(quantization=None, num_attention_heads=full.num_attention_heads,
                        intermediate_size=full.intermediate_size, moe_intermediate_size=full.moe_intermediate_size,
                        vocab_size=full.vocab_size) == full
    one = DSAModel(rank.replace(quantization=None), device="meta")
    tp8 = DSAModel(full, tp_group=fake_groups(8, "meta")[0])
    assert {k: v.shape for k, v in one.state_dict().items()} == {k: v.shape for k, v in tp8.state_dict().items()}


def test_tp_rank_config_names_what_does_not_divide():
    with pytest.raises(ValueError, match=re.escape("tp 3 must divide ModelConfig.num_attention_heads (64)")):
        tp_rank_config(get_config("glm5-moe"), 3, "x")
    with pytest.raises(ValueError, match="tp must be a positive int, got 0"):
        tp_rank_config(get_config("glm5-moe"), 0, "x")


def fp8_weight_bytes(config: ModelConfig) -> int:
    """Bytes of the model's weights with FP8 routed experts, from its bf16 twin on meta: the
    projections the quantization converts as Fp8Linear (e4m3 + fp32 block scales), the experts as
    e4m3 + one fp32 scale per 128 x 128 block of each expert's matrix, the rest as built."""
    model = DSAModel(config.replace(quantization=None), device="meta")
    convert_to_fp8(model, config.quantization, torch.device("meta"))
    experts = {id(p) for m in model.modules() if isinstance(m, RoutedExperts) for p in m.parameters()}
    total = 0
    for param in model.parameters():
        if id(param) in experts:
            count, rows, cols = param.shape
            total += param.numel() + count * math.ceil(rows / 128) * math.ceil(cols / 128) * 4
        else:
            total += param.numel() * param.element_size()
    return total


@pytest.mark.parametrize("name,full_name,quant", RANK_PRESETS, ids=[r[0] for r in RANK_PRESETS])
def test_tp8_rank_presets_fit_an_h200_at_full_depth(name, full_name, quant):
    """FP8 weights (96.9 GB GLM-5, 87.9 GB DeepSeek-V3.2 a rank) + the KV pools and table of
    bench e2e's largest allocation (max concurrency, the longest chain S = 5, 1M-token table) stay
    under 130 GB."""
    config = get_config(name)
    weights = fp8_weight_bytes(config)
    bench = defaults_of(e2e.add_arguments)
    requests, draft = max(bench["concurrency"]), max(e2e.CHAINS) + 1
    written = bench["prompt_len"] + (bench["iterations"] + 1) * draft
    slots = PAGE_SIZE * (1 + requests * -(-written // PAGE_SIZE))
    kv = sum(KVPool.for_model(config, slots, mtp=mtp, device="meta").nbytes() for mtp in (False, True))
    table = ReqToTokenPool.table_nbytes(requests, max(bench["contexts"]), draft)
    assert 80e9 < weights and weights + kv + table < H200_BUDGET, (weights, kv, table)
