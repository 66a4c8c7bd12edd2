"""The shared expert run inside the fused MoE (``MoE.fuse_shared_experts``, ``dsaspec.layers.moe``):
one storage of E + 1 experts whose parameters are views, the router kernel's extra slot, and the
layer's output against the separate MLP's and the reference.

* The fused layer (routed + shared in one ``fused_moe`` call) against the unfused one (torch
  experts + the separate shared MLP): fp32 within 1e-5, bf16 within 2**-5 (tests/test_fused_moe.py:
  the interpreter truncates bf16 casts; the two paths also round differently: the fused one sums
  the shared output in fp32), FP8 within 1e-3 (an activation one ulp off can take the neighbouring
  e4m3 code).
* The views: every parameter lies where it should in the stacked storages, the storages hold no
  byte that is not a parameter's, a checkpoint write of the shared expert reaches the fused call,
  moves and conversions stack again, a part moved on its own is refused.
* Where the shared expert does not fit (two shared experts, another weight format) the separate
  MLP runs, as before.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsaspec.configs.model_config import get_config
from dsaspec.configs.quantization import Fp8Quantization
from dsaspec.layers.moe import MoE
from dsaspec.models.dsa_model import DSAModel
from dsaspec.models.loader import SINGLE_FILE, load_checkpoint, save_checkpoint
from dsaspec.reference.fused_moe import fused_moe_fp8 as fp8_reference
from fake_tp import fake_groups, run_ranks

# CPU models whose Triton ops run under the interpreter: on a CUDA host only the gpu-marked tests run
pytestmark = [pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),  # FP8 NaN padding rows
              pytest.mark.interpreter]

FP8 = Fp8Quantization()
SHARED = "model.layers.1.mlp.shared_experts"


def _model(dtype=torch.float32, quant=None, seed=4, **overrides) -> DSAModel:
    config = get_config("tiny-moe", quantization=quant, **overrides)
    return DSAModel(config, dtype=dtype, use_triton=True).init_weights(seed)


def _x(model, tokens=5, seed=1):
    config = model.config
    return torch.randn(tokens, config.hidden_size, generator=torch.Generator().manual_seed(seed)).to(
        model.lm_head.weight.dtype)


def _both_paths(mlp: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fused, unfused) outputs of the layer; the fused call must not run the separate MLP when the
    shared expert is stacked, and the unfused one must."""
    calls = []
    partial = mlp.shared_experts.partial
    mlp.shared_experts.partial = lambda h: calls.append(1) or partial(h)
    try:
        with torch.no_grad():
            fused = mlp(x)
            assert calls == ([] if mlp.experts.stacked is not None else [1])
            mlp.experts.use_fused = False
            unfused = mlp(x)
            assert calls[-1:] == [1]
    finally:
        mlp.experts.use_fused = True
        del mlp.shared_experts.partial
    return fused, unfused


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-5, atol=2**-5)}


@pytest.mark.parametrize("dtype,quant", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, FP8)],
                         ids=["fp32", "bf16", "fp8"])
def test_fused_layer_runs_the_shared_expert_and_matches_the_separate_mlp(dtype, quant):
    """The router hands the fused call k + 1 slots (the last expert E at weight 1.0) and the
    separate MLP does not run; the output is the unfused layer's."""
    model = _model(dtype, quant)
    mlp, config = model.model.layers[1].mlp, model.config
    assert mlp.experts.use_fused and mlp.experts.stacked is not None
    routes = []
    hook = mlp.gate.register_forward_hook(lambda module, args, out: routes.append(out))
    x = _x(model)
    fused, unfused = _both_paths(mlp, x)
    hook.remove()
    ids, weights = routes[0]
    k, experts = config.num_experts_per_tok, config.n_routed_experts
    assert ids.shape == (5, k + 1) and ids[:, k].tolist() == [experts] * 5 and weights[:, k].tolist() == [1.0] * 5
    assert routes[1][0].shape == (5, k)  # unfused: the routed slots only
    torch.testing.assert_close(fused, unfused, **(dict(rtol=1e-3, atol=1e-3) if quant else TOL[dtype]))


@pytest.mark.parametrize("quant", [None, FP8], ids=["bf16", "fp8"])
def test_the_shared_expert_takes_no_memory_of_its_own(quant):
    """``w13`` / ``w2`` (and scales) view experts 0..E-1 of the stacked storages; the shared MLP's
    ``gate_proj`` / ``up_proj`` (and its fused ``gate_up``) view expert E of ``w13``, ``down_proj``
    expert E of ``w2``; and the model's parameters' storages hold exactly the parameters' bytes."""
    model = _model(torch.bfloat16, quant)
    for layer in (model.model.layers[1], model.mtp_layer):
        experts, mlp = layer.mlp.experts, layer.mlp.shared_experts
        stacked, e, rows = experts.stacked, experts.num_experts, experts.intermediate
        suffixes = ("", "_scale_inv") if quant else ("",)
        assert set(stacked) == {f"w{n}{s}" for n in (13, 2) for s in suffixes}
        for s in suffixes:
            w13, w2 = stacked[f"w13{s}"], stacked[f"w2{s}"]
            assert w13.shape[0] == w2.shape[0] == e + 1
            half = rows // (128 if s else 1)
            for view, where in ((getattr(experts, f"w13{s}"), w13[:e]), (getattr(experts, f"w2{s}"), w2[:e]),
                                (getattr(mlp.gate_proj, f"weight{s}"), w13[e, :half]),
                                (getattr(mlp.up_proj, f"weight{s}"), w13[e, half:]),
                                (getattr(mlp.gate_up.gemm, f"weight{s}"), w13[e]),
                                (getattr(mlp.down_proj, f"weight{s}"), w2[e])):
                assert view.shape == where.shape and view.data_ptr() == where.data_ptr()
                assert view.untyped_storage().data_ptr() == where.untyped_storage().data_ptr()
    params = list(model.parameters())
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}
    assert sum(storages.values()) == sum(p.nbytes for p in params)


def test_state_dict_and_values_are_those_of_the_unstacked_model(monkeypatch):
    """Same names, shapes, dtypes and (same seed) bits as a model whose shared experts are not
    stacked; the checkpoint shapes too."""
    stacked = _model(quant=FP8)
    monkeypatch.setattr(MoE, "fuse_shared_experts", lambda self: None)
    plain = _model(quant=FP8)
    assert plain.model.layers[1].mlp.experts.stacked is None
    got, want = stacked.state_dict(), plain.state_dict()
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape and got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert stacked.checkpoint_shapes() == plain.checkpoint_shapes()


def test_a_checkpoint_write_of_the_shared_expert_reaches_the_fused_call(tmp_path):
    """Load an FP8 checkpoint whose shared expert was replaced (routed expert 0's tensors): the
    stacked storage holds the stored codes and scales, and the fused layer equals the reference over
    the stored shared tensors (and the loaded experts)."""
    save_checkpoint(_model(quant=FP8), tmp_path)
    tensors = load_file(str(tmp_path / SINGLE_FILE))
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for suffix in ("weight", "weight_scale_inv"):
            tensors[f"{SHARED}.{proj}.{suffix}"] = tensors[f"model.layers.1.mlp.experts.0.{proj}.{suffix}"].clone()
    save_file(tensors, str(tmp_path / SINGLE_FILE))
    model = load_checkpoint(tmp_path, dtype=torch.float32, use_triton=True)
    mlp, k = model.model.layers[1].mlp, model.config.num_experts_per_tok
    experts, e = mlp.experts, mlp.experts.num_experts
    u8 = torch.uint8
    assert torch.equal(experts.stacked["w2"][e].view(u8), tensors[f"{SHARED}.down_proj.weight"].view(u8))
    assert torch.equal(experts.stacked["w13_scale_inv"][e], experts.w13_scale_inv[0])
    x = _x(model, tokens=3)
    with torch.no_grad():
        ids, weights = mlp.gate(x)
        got = mlp(x)
    shared = tuple((tensors[f"{SHARED}.{p}.weight"], tensors[f"{SHARED}.{p}.weight_scale_inv"])
                   for p in ("gate_proj", "up_proj", "down_proj"))
    want = fp8_reference(x, experts.w13, experts.w13_scale_inv, experts.w2, experts.w2_scale_inv, ids[:, :k],
                         weights[:, :k], shared=shared)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_a_conversion_stacks_again_and_a_part_moved_alone_is_refused():
    """bf16 -> fp32 (``.float()``): every parameter keeps its value, the views are rebuilt over new
    fp32 storages, an in-place write of the shared ``down_proj`` reaches the fused call, and the
    layer matches the separate MLP; converting the routed experts alone breaks the views, which the
    fused call refuses."""
    model = _model(torch.bfloat16)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    model.float()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name].float()), name
    mlp = model.model.layers[1].mlp
    experts, e = mlp.experts, mlp.experts.num_experts
    assert experts.stacked["w13"].dtype == torch.float32
    assert mlp.shared_experts.down_proj.weight.data_ptr() == experts.stacked["w2"][e].data_ptr()
    assert mlp.shared_experts.gate_up.gemm.weight.data_ptr() == experts.stacked["w13"][e].data_ptr()
    with torch.no_grad():
        mlp.shared_experts.down_proj.weight.mul_(-3.0)
    x = _x(model)
    fused, unfused = _both_paths(mlp, x)
    torch.testing.assert_close(fused, unfused, **TOL[torch.float32])
    experts.double()
    with pytest.raises(RuntimeError, match="no longer view their stacked storage"):
        mlp(x.double())


def test_where_the_shared_expert_does_not_fit_the_separate_mlp_runs():
    """Two shared experts (a 2 I_r-wide shard: its gate rows cannot view two experts' interleaved
    gate and up rows) and FP8 routed experts beside a bf16 shared expert stay unstacked; the fused
    layer then adds the separate MLP, as before."""
    two = _model(n_shared_experts=2)
    mixed = _model(quant=Fp8Quantization(modules_to_not_convert=("shared_experts",)))
    for model in (two, mixed):
        mlp = model.model.layers[1].mlp
        assert mlp.experts.use_fused and mlp.experts.stacked is None and mlp.shared_experts.gate_up is not None
    fused, unfused = _both_paths(two.model.layers[1].mlp, _x(two, tokens=3))
    torch.testing.assert_close(fused, unfused, **TOL[torch.float32])


def test_tp2_ranks_stack_their_shards_and_sum_to_tp1():
    """At TP 2 each rank's shared shard (I / 2 features) is its expert E; the fused layers of the
    two ranks sum (the all-reduce) to the TP 1 layer."""
    config = get_config("tiny-moe")
    x = torch.randn(3, config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = DSAModel(config, dtype=torch.float32).init_weights(3).model.layers[1].mlp(x)

    def rank(group):
        model = DSAModel(config, dtype=torch.float32, use_triton=True, tp_group=group).init_weights(3)
        mlp = model.model.layers[1].mlp
        assert mlp.experts.stacked["w13"].shape == (config.n_routed_experts + 1, 128, config.hidden_size)
        with torch.no_grad():
            return mlp(x)

    for got in run_ranks(fake_groups(2), rank):
        torch.testing.assert_close(got, want, **TOL[torch.float32])


# -------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
def test_gpu_cuda_move_restacks_and_graph_replays():
    """A CPU-built FP8 model moved with ``.cuda()``: the views are rebuilt on the GPU, the fused
    layer matches the separate MLP, and a CUDA graph of the layer replays new hidden states bit for
    bit as eager calls."""
    model = DSAModel(get_config("tiny-moe", quantization=FP8), dtype=torch.bfloat16).init_weights(4).cuda()
    model.use_triton = True
    mlp = model.model.layers[1].mlp
    experts, e = mlp.experts, mlp.experts.num_experts
    assert experts.use_fused and experts.stacked["w13"].is_cuda
    assert mlp.shared_experts.down_proj.weight.data_ptr() == experts.stacked["w2"][e].data_ptr()
    x = _x(model, tokens=8).cuda()
    fused, unfused = _both_paths(mlp, x)
    error = float((fused.double() - unfused.double()).norm() / unfused.double().norm())
    assert error <= 2**-4, error
    static = x.clone()
    with torch.no_grad():
        mlp(static)  # compile outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = mlp(static)
        for seed in (5, 6):
            static.copy_(_x(model, tokens=8, seed=seed))
            graph.replay()
            assert torch.equal(out, mlp(static)), f"seed {seed}: replay differs from eager"


@pytest.mark.gpu
def test_gpu_glm5_rank_layer_matches_the_separate_mlp():
    """One MoE layer of the GLM-5 FP8 TP 8 rank (E 256 + 1, k 8 + 1, H 6144, I_r 256): the fused
    layer within 2**-4 normwise of the torch experts + separate MLP at T = 1, 8; the shared expert's
    weights are views (storages hold only the parameters' bytes)."""
    config = get_config("glm5-fp8-tp8-rank", num_hidden_layers=4, num_nextn_predict_layers=0)
    model = DSAModel(config, device="cuda", use_triton=True).init_weights(0)
    mlp = model.model.layers[3].mlp
    assert mlp.experts.stacked["w13"].shape == (257, 512, 6144)
    params = list(mlp.parameters())
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}
    assert sum(storages.values()) == sum(p.nbytes for p in params)
    for tokens in (1, 8):
        fused, unfused = _both_paths(mlp, _x(model, tokens=tokens).cuda())
        error = float((fused.double() - unfused.double()).norm() / unfused.double().norm())
        assert error <= 2**-4, f"T={tokens}: {error}"
