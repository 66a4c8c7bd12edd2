"""Parity with an independently written implementation: Hugging Face transformers'
``DeepseekV32ForCausalLM`` and ``GlmMoeDsaForCausalLM``, dense (``first_k_dense_replace =
num_hidden_layers``) and with MoE layers.

Tiny random fp32 models of both are built with transformers, written with ``save_pretrained``
(safetensors + HF ``config.json``), read back with ``dsaspec.models.loader.load_checkpoint`` and run
through the runtime's eager prefill (plain-torch ops). The prompt is longer than ``index_topk``, so the
indexer's selection decides what later rows attend to; 32 indexer heads make an exact tie of the
summed ReLU scores (which ``torch.topk`` breaks arbitrarily) negligible. DeepSeek-V3.2 runs YaRN with
``mscale != mscale_all_dim`` and half-split indexer RoPE; GLM-5 plain RoPE, interleaved indexer RoPE
and its 1e-5 layer-norm eps; GLM-5 with IndexShare (``index_topk_freq = 2``: four layers full,
shared, full, shared, a shared layer attending to the previous full layer's top-k). The MoE cases of both: layer 0 dense,
layer 1 MoE with 8 routed experts in 4 groups (2 groups, 3 experts per token), one shared expert,
``routed_scaling_factor`` 2.5 and a non-zero ``e_score_correction_bias``, so the group limit, the
bias (choice only) and the weight normalisation all decide the output.

Not covered, because transformers has no counterpart: the MTP layer (HF drops ``model.layers.{L}.*``
on load). Needs the ``parity`` extra (transformers >= 5.13: the first release with both classes and
GLM-5's interleaved indexer RoPE); skipped otherwise.
"""

import math

import pytest
import torch

from safetensors.torch import save_file

from dsaspec.configs.model_config import ModelConfig, get_config
from dsaspec.models.loader import load_checkpoint, save_checkpoint
from dsaspec.memory import KVPool, PageAllocator, ReqToTokenPool, RequestSlots
from dsaspec.models.dsa_model import DSAModel

# 5.11 added DeepseekV32ForCausalLM; before 5.13 GlmMoeDsa's indexer applied half-split RoPE (GLM-5's is
# interleaved: its config.json says indexer_rope_interleave: true).
hf = pytest.importorskip("transformers", minversion="5.13",
                         reason="the HF parity test needs the 'parity' extra (transformers >= 5.13)")

PROMPT_LEN = 90      # > index_topk = 64: sparse selection for rows 64..89
GREEDY_STEPS = 6
ATOL = 1e-4

# The runtime's tiny dims, with what the HF classes need on top: 32 indexer heads, every layer dense.
_TINY = get_config("tiny")
_DIMS = {name: getattr(_TINY, name) for name in (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_head_dim",
    "index_topk")}
_DIMS.update(num_key_value_heads=_TINY.num_attention_heads, index_n_heads=32,
             first_k_dense_replace=_TINY.num_hidden_layers, max_position_embeddings=256)

_GLM5_ROPE = {"rope_type": "default", "rope_theta": 1e6}
_DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
                  "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 1.0}
_MOE = dict(first_k_dense_replace=1, n_routed_experts=8, moe_intermediate_size=128, num_experts_per_tok=3,
            n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
MODELS = {      # case: (HF config class, HF model class, config arguments on top of _DIMS)
    # max_position_embeddings / original_max_position_embeddings == factor, as HF's YaRN expects.
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(rms_norm_eps=1e-6,
                                                                         rope_parameters=_DEEPSEEK_YARN)),
    "deepseek_v32-moe": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(
        rms_norm_eps=1e-6, rope_parameters=_DEEPSEEK_YARN, **_MOE)),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(rms_norm_eps=1e-5, rope_parameters=_GLM5_ROPE)),
    "glm_moe_dsa-index-share": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(
        rms_norm_eps=1e-5, rope_parameters=_GLM5_ROPE, num_hidden_layers=4, first_k_dense_replace=4,
        index_topk_freq=2, index_skip_topk_offset=1)),
    "glm_moe_dsa-moe": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(
        rms_norm_eps=1e-5, rope_parameters=_GLM5_ROPE, **_MOE)),
}


def _hf_config(case: str):
    config_cls, _, extra = MODELS[case]
    return getattr(hf, config_cls)(**{**_DIMS, **extra})


def _indexer_types(hf_config) -> tuple[str, ...] | None:
    """The HF config's per-layer indexer types as ModelConfig holds them (None: every layer full)."""
    types = getattr(hf_config, "indexer_types", None)
    return None if types is None or all(t == "full" for t in types) else tuple(types)


def _hf_model(case: str):
    config = _hf_config(case)
    model_cls = MODELS[case][1]
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(hf, model_cls)(config).float().eval()
    # HF's own init (std 0.02) leaves the indexer scores near zero, where ReLU ties everything.
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("embed_tokens.weight"):
                param.copy_(noise)
            elif param.dim() >= 2:      # projections, the router, the fused experts [E, out, in]
                param.copy_(noise / math.sqrt(param.shape[-1]))
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(1.0 + 0.1 * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
    return model


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request, tmp_path_factory):
    """(HF model, our model loaded from the HF checkpoint, HF model_type)."""
    model = _hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    assert (path / "model.safetensors").is_file()
    return model, load_checkpoint(path, dtype=torch.float32, use_triton=False), model.config.model_type


class _Request:
    """One request in the runtime's memory, extended by eager prefill calls."""

    def __init__(self, model, capacity: int = 128):
        num_slots = 4 * capacity
        self.model = model
        self.pool = ReqToTokenPool(1, capacity)
        self.slots = RequestSlots(self.pool, PageAllocator(num_slots))
        self.kv = KVPool.for_model(model.config, num_slots, dtype=torch.float32)
        self.row = None
        self.length = 0

    def extend(self, ids: torch.Tensor) -> torch.Tensor:
        """Prefill ``ids`` after what the request holds; fp32 logits ``[len(ids), vocab]``."""
        if self.row is None:
            self.row = self.slots.admit(ids.numel())
        self.slots.extend(self.row, self.length + ids.numel())
        hidden = self.model.prefill(ids, self.pool.req_to_token, self.row, self.kv, prefix_len=self.length)
        self.length += ids.numel()
        return self.model.logits(hidden)


def _prompt(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(2))


def test_config_read_from_hf_checkpoint(pair):
    model, ours, model_type = pair
    config = ours.config
    assert config.model_type == model_type
    assert config.indexer_rope_interleave == (model_type == "glm_moe_dsa")  # HF: GLM interleaved, V3.2 half-split
    assert config.num_nextn_predict_layers == 0  # HF has no MTP layer
    assert config.softmax_scale == pytest.approx(model.model.layers[0].self_attn.scaling, rel=1e-12)
    assert (config.index_n_heads, config.index_topk) == (32, 64) and PROMPT_LEN > config.index_topk
    assert config.indexer_types == _indexer_types(model.config)
    assert [layer.self_attn.indexer is None for layer in ours.model.layers] == \
        [getattr(layer.self_attn, "indexer", None) is None for layer in model.model.layers]
    hf_moe = [kind == "sparse" for kind in model.config.mlp_layer_types]
    assert [config.is_moe_layer(i) for i in range(config.num_hidden_layers)] == hf_moe
    assert [hasattr(layer.mlp, "experts") for layer in ours.model.layers] == hf_moe
    if any(hf_moe):
        for name in _MOE:
            assert getattr(config, name) == getattr(model.config, name), name
        layer = hf_moe.index(True)
        bias = model.model.layers[layer].mlp.gate.e_score_correction_bias
        assert bias.abs().min() > 0
        assert torch.equal(ours.model.layers[layer].mlp.gate.e_score_correction_bias, bias)


def test_prefill_logits_match(pair):
    model, ours, _ = pair
    ids = _prompt(ours.config.vocab_size)
    with torch.no_grad():
        expected = model(ids[None]).logits[0].float()
    logits = _Request(ours).extend(ids)
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_greedy_tokens_match(pair):
    """Greedy continuation: ours decodes one token at a time on the paged caches, HF recomputes the
    whole sequence each step. A step whose top two HF logits are within ATOL may flip either way, so
    the comparison stops there (none does with these seeds: at least 4 steps must be compared)."""
    model, ours, _ = pair
    request = _Request(ours)
    tokens = _prompt(ours.config.vocab_size)
    logits = request.extend(tokens)[-1]
    compared = 0
    for _ in range(GREEDY_STEPS):
        with torch.no_grad():
            expected = model(tokens[None]).logits[0, -1].float()
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
        top2 = expected.topk(2).values
        if top2[0] - top2[1] <= ATOL:
            break
        token = int(expected.argmax())
        assert int(logits.argmax()) == token
        compared += 1
        tokens = torch.cat([tokens, torch.tensor([token])])
        logits = request.extend(tokens[-1:])[0]
    assert compared >= 4


@pytest.mark.parametrize("case", sorted(MODELS))
def test_our_checkpoint_runs_in_transformers(case, tmp_path):
    """The other direction: a checkpoint written by ``save_checkpoint`` loads in transformers (which
    ignores the MTP layer's tensors) and gives the same prefill logits."""
    hf_config = _hf_config(case)
    model_type = hf_config.model_type
    rope = MODELS[case][2]["rope_parameters"]
    scaling = None if rope["rope_type"] == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
    moe = {name: getattr(hf_config, name) for name in _MOE} if "n_routed_experts" in MODELS[case][2] else {}
    config = _TINY.replace(index_n_heads=32, model_type=model_type, rope_scaling=scaling,
                           indexer_rope_interleave=model_type == "glm_moe_dsa",
                           num_hidden_layers=hf_config.num_hidden_layers, indexer_types=_indexer_types(hf_config),
                           **moe)
    ours = DSAModel(config, dtype=torch.float32).init_weights(3)
    save_checkpoint(ours, tmp_path)
    model = hf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager")
    ids = _prompt(config.vocab_size)
    with torch.no_grad():
        expected = model.eval()(ids[None]).logits[0].float()
    torch.testing.assert_close(_Request(ours).extend(ids), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("preset,config_cls", [("glm5-moe", "GlmMoeDsaConfig"),
                                               ("deepseek-v32-moe", "DeepseekV32Config")])
def test_presets_have_the_reference_configs_shapes(preset, config_cls):
    """HF's config classes default to the released models' shapes, MoE included. Equal on every
    field except what those classes do not carry: the checkpoints' RoPE settings and the MTP layer."""
    ours = ModelConfig.from_hf_dict(getattr(hf, config_cls)().to_dict())
    rope_and_mtp = dict(rope_theta=get_config(preset).rope_theta, rope_scaling=get_config(preset).rope_scaling,
                        num_nextn_predict_layers=get_config(preset).num_nextn_predict_layers)
    assert ours.replace(**rope_and_mtp) == get_config(preset)


def test_transformers_fused_expert_tensors_load(pair, tmp_path):
    """transformers holds the experts fused (``mlp.experts.gate_up_proj`` ``[E, 2I, hidden]``,
    ``down_proj`` ``[E, hidden, I]``) and writes them per expert; a checkpoint of its in-memory
    tensors loads to the same parameters as the per-expert one."""
    model, ours, _ = pair
    if not ours.routed_experts():
        pytest.skip("dense case")
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    model.config.to_json_file(tmp_path / "config.json")
    fused = load_checkpoint(tmp_path, dtype=torch.float32)
    for (name, a), b in zip(ours.state_dict().items(), fused.state_dict().values()):
        assert torch.equal(a, b), name
