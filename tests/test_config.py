"""ModelConfig: presets carry the real shapes, HF dicts round-trip, bad values give clear errors."""

import math

import pytest

from dsaspec.runtime.config import PRESETS, ModelConfig, get_config


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_validate_and_round_trip_through_hf_dict(name):
    config = get_config(name)
    assert config.kv_cache_dim == 576 and config.index_head_dim == 128
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


def test_glm5_shapes():
    c = get_config("glm5")
    assert (c.hidden_size, c.vocab_size, c.num_attention_heads) == (6144, 154880, 64)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == \
        (2048, 512, 192, 64, 256)
    assert (c.index_n_heads, c.index_topk, c.indexer_rope_interleave) == (32, 2048, True)
    assert c.num_attention_heads * c.qk_head_dim == 16384                       # q_b_proj out
    assert c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim) == 28672  # kv_b_proj out
    assert c.softmax_scale == 256 ** -0.5


def test_deepseek_v32_shapes_and_yarn_scale():
    c = get_config("deepseek_v32")
    assert (c.hidden_size, c.vocab_size, c.num_attention_heads, c.q_lora_rank) == (7168, 129280, 128, 1536)
    assert (c.qk_nope_head_dim, c.v_head_dim, c.index_n_heads, c.indexer_rope_interleave) == (128, 128, 64, False)
    mscale = 0.1 * math.log(40) + 1
    assert c.softmax_scale == pytest.approx(192 ** -0.5 * mscale ** 2)


def test_bench_keeps_glm5_attention_and_vocab():
    glm, bench = get_config("glm5"), get_config("bench")
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "q_lora_rank", "qk_nope_head_dim",
                "v_head_dim", "index_n_heads", "index_topk", "indexer_rope_interleave"):
        assert getattr(bench, key) == getattr(glm, key), key
    assert bench.num_hidden_layers == 2


def _glm5_hf_dict():
    """An HF GLM-5 style config.json (MoE fields present, rope in rope_parameters, no layout key)."""
    return {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
        "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
        "moe_intermediate_size": 2048, "num_hidden_layers": 78, "num_attention_heads": 64,
        "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
        "v_head_dim": 256, "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048,
        "n_routed_experts": 256, "rms_norm_eps": 1e-5, "max_position_embeddings": 202752,
        "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
        "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
    }


def test_from_hf_dict_reads_glm5_and_picks_layout_by_model_type():
    config = ModelConfig.from_hf_dict(_glm5_hf_dict())
    assert config == get_config("glm5")
    deepseek = dict(_glm5_hf_dict(), model_type="deepseek_v32")
    assert ModelConfig.from_hf_dict(deepseek).indexer_rope_interleave is False
    explicit = dict(_glm5_hf_dict(), indexer_rope_interleave=False)
    assert ModelConfig.from_hf_dict(explicit).indexer_rope_interleave is False


def test_from_hf_dict_reads_yarn_rope_scaling():
    hf = get_config("deepseek_v32").to_hf_dict()
    config = ModelConfig.from_hf_dict(hf)
    assert config.rope_scaling["factor"] == 40.0 and config.rope_theta == 10000.0


@pytest.mark.parametrize("change, message", [
    ({"kv_lora_rank": 256}, "kv_lora_rank=512"),
    ({"qk_rope_head_dim": 32}, "qk_rope_head_dim=64"),
    ({"index_head_dim": 64}, "index_head_dim must be 128"),
    ({"hidden_size": 0}, "hidden_size must be a positive int"),
    ({"num_attention_heads": 2.5}, "num_attention_heads must be a positive int"),
    ({"index_topk": True}, "index_topk must be a positive int"),
    ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers must be 0 or 1"),
    ({"indexer_rope_interleave": "yes"}, "indexer_rope_interleave must be a bool"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps must be a positive number"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "only YaRN"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "original_max_position_embeddings"),
])
def test_validate_names_the_bad_field(change, message):
    with pytest.raises(ValueError, match=message):
        get_config("tiny", **change)


def test_from_hf_dict_names_missing_keys():
    hf = _glm5_hf_dict()
    del hf["q_lora_rank"], hf["index_topk"]
    with pytest.raises(ValueError, match=r"missing required key\(s\) \['q_lora_rank', 'index_topk'\]"):
        ModelConfig.from_hf_dict(hf)
    with pytest.raises(ValueError, match="expects a dict"):
        ModelConfig.from_hf_dict([("hidden_size", 1)])


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown model preset 'glm6'"):
        get_config("glm6")
