"""One GEMM for the projections that read one input (``layers.fused_linear.fuse_linears``): the parts'
parameters view the fused weight (and FP8 scales), the fused outputs are the parts' outputs, and what
cannot be fused is refused.
"""

import pytest
import torch

from dsaspec.configs.model_config import get_config
from dsaspec.configs.quantization import Fp8Quantization
from dsaspec.layers.fp8_linear import Fp8Linear
from dsaspec.layers.fused_linear import FusedLinear, fuse_linears
from dsaspec.layers.linear import Linear
from dsaspec.models.dsa_model import DSAModel
from dsaspec.ops import row_invariant as ri

# CPU models (the row-invariant GEMM under the interpreter).
pytestmark = pytest.mark.interpreter


def _fused_groups(model):
    return [(name, module) for name, module in model.named_modules() if isinstance(module, FusedLinear)]


@pytest.mark.parametrize("quantization", [None, Fp8Quantization()], ids=["bf16", "fp8"])
def test_model_fuses_views_and_keeps_checkpoint_names(quantization):
    config = get_config("tiny", quantization=quantization)
    model = DSAModel(config, dtype=torch.bfloat16).init_weights(3)
    groups = _fused_groups(model)
    layers = config.num_hidden_layers + config.num_nextn_predict_layers
    attn = [n for n, _ in groups if n.endswith("self_attn.fused_input")]
    latent = [n for n, _ in groups if n.endswith("self_attn.fused_latent")]
    mlp = [n for n, _ in groups if n.endswith("mlp.gate_up")]
    assert len(attn) == layers and len(latent) == layers and len(mlp) == layers   # tiny: an indexer in every layer
    assert len(groups) == 3 * layers
    assert not any("fused_input" in k or "fused_latent" in k or "gate_up" in k for k in model.state_dict())
    names = ("weight", "weight_scale_inv") if quantization else ("weight",)
    for _, fused in groups:
        assert type(fused.gemm) is (Fp8Linear if quantization else Linear)
        for name in names:
            whole = getattr(fused.gemm, name)
            assert torch.equal(whole, torch.cat([getattr(p, name) for p in fused._parts]))
            start = 0
            for part in fused._parts:  # a view: init_weights and loads write the fused tensor
                assert getattr(part, name).data_ptr() == whole[start:].data_ptr()
                start += getattr(part, name).shape[0]
    indexed = model.model.layers[0].self_attn
    assert indexed.fused_input._parts == (indexed.q_a_proj, indexed.indexer.wk, indexed.kv_a_proj_with_mqa)
    assert indexed.fused_latent._parts == (indexed.q_b_proj, indexed.indexer.wq_b)


def test_layers_without_an_indexer_fuse_no_latent_gemm():
    """A shared-indexer layer (IndexShare) has no ``wq_b``: ``q_b_proj`` stays alone."""
    config = get_config("tiny", num_hidden_layers=3, indexer_types=("full", "shared", "full"))
    attns = [layer.self_attn for layer in DSAModel(config, dtype=torch.float32).model.layers]
    assert [a.fused_latent is not None for a in attns] == [True, False, True, True]
    assert attns[1].fused_input._parts == (attns[1].q_a_proj, attns[1].kv_a_proj_with_mqa)


def test_fp8_latent_gemm_needs_whole_scale_blocks_of_q_b_proj():
    """FP8: ``q_b_proj`` comes first, so its rows must fill whole 128-row scale blocks; at 4 x (16 +
    64) = 320 rows the layers keep ``q_b_proj`` and ``wq_b`` apart (bf16 weights fuse them)."""
    for quantization, fused in ((Fp8Quantization(), False), (None, True)):
        config = get_config("tiny", qk_nope_head_dim=16, quantization=quantization)
        model = DSAModel(config, dtype=torch.bfloat16)
        assert all((layer.self_attn.fused_latent is not None) == fused for layer in model.model.layers)
        assert all(layer.self_attn.fused_input is not None for layer in model.model.layers)


@pytest.mark.parametrize("row_invariant", [False, True])
def test_fused_outputs_are_the_parts_outputs(row_invariant):
    """The fused GEMM at the default config of its N gives what the parts' GEMMs give (fp32 CPU:
    bitwise where each K fits one block, so no split sum can differ)."""
    model = DSAModel(get_config("tiny"), dtype=torch.float32, row_invariant=row_invariant).init_weights(5)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, fused in _fused_groups(model):
            x = torch.randn(9, fused.gemm.in_features, generator=gen)
            for got, part in zip(fused(x), fused._parts):
                want = part(x)
                if row_invariant:
                    assert torch.equal(got, want)
                else:
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_row_invariant_fused_gemm_is_bitwise_the_separate_gemms_at_one_config():
    """At one configuration (the same K blocks and split) every output column of the fused
    row-invariant GEMM is bitwise the separate GEMM's: K = 6144 split in 6, the GLM-5 q_a / wk /
    kv_a widths scaled down (each a multiple of the 64-column tile, as 2048 / 128 / 576 are not all)."""
    k, sizes = 6144, (192, 64, 96)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, k, generator=gen)
    parts = [torch.randn(n, k, generator=gen) * k ** -0.5 for n in sizes]
    config = ri.GemmConfig(16, 32, 32, 6, 4, 3)
    fused = ri.linear(x, torch.cat(parts), config=config)
    for got, w in zip(fused.split(sizes, dim=-1), parts):
        assert torch.equal(got, ri.linear(x, w, config=config))


def _fp8(n, k=128):
    return Fp8Linear(k, n, "cpu", dtype=torch.float32)


def test_refused_groups_stay_unfused():
    assert fuse_linears([_fp8(576), _fp8(128)]) is None      # 576 rows: its last scale block is half kv_a's
    assert fuse_linears([_fp8(128), _fp8(576)]) is not None
    assert fuse_linears([Linear(128, 64, bias=False), _fp8(128)]) is None
    assert fuse_linears([Linear(128, 64, bias=False), Linear(64, 64, bias=False)]) is None
    assert fuse_linears([Linear(8, 4, bias=False), Linear(8, 4, bias=False, dtype=torch.bfloat16)]) is None


def test_fp8_fused_scales_follow_the_rows():
    parts = [_fp8(128), _fp8(130)]
    gen = torch.Generator().manual_seed(2)
    for p in parts:
        p.set_dense(torch.randn(p.out_features, 128, generator=gen))
    x = torch.randn(4, 128, generator=gen)
    before = [(part(x), part.weight.clone(), part.weight_scale_inv.clone()) for part in parts]
    fused = fuse_linears(parts)
    assert fused.gemm.weight_scale_inv.shape == (1 + 2, 1)
    for got, part, (want, weight, scale) in zip(fused(x), parts, before):
        assert torch.equal(part.weight.float(), weight.float()) and torch.equal(part.weight_scale_inv, scale)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_parts_no_longer_viewing_the_fused_weight_are_refused():
    a, b = Linear(8, 4, bias=False), Linear(8, 4, bias=False)
    fused = fuse_linears([a, b])
    a.weight.data = a.weight.data.clone()   # what moving a part on its own does
    with pytest.raises(RuntimeError, match="no longer view the fused weight"):
        fused(torch.zeros(2, 8))


def _views_its_fused_weight(fused) -> bool:
    base = fused.gemm.weight
    return all(p.weight.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() for p in fused._parts) \
        and torch.equal(base, torch.cat([p.weight for p in fused._parts]))


@pytest.mark.parametrize("quantization", [None, Fp8Quantization()], ids=["bf16", "fp8"])
def test_moving_the_model_fuses_again(quantization):
    """A move of the model (every tensor to new storage, as ``.to(device)`` does; and ``.float()``
    for bf16 weights) moves the parts and the fused tensors apart; afterwards every fused layer
    views its parts' moved values again and computes the parts' outputs."""
    config = get_config("tiny", quantization=quantization)
    model = DSAModel(config, dtype=torch.bfloat16).init_weights(0)
    fused = [m for m in model.modules() if isinstance(m, FusedLinear)]
    assert fused and all(_views_its_fused_weight(f) for f in fused)
    model._apply(lambda t: t.clone())
    if quantization is None:
        model.float()
        assert all(f.gemm.weight.dtype == torch.float32 for f in fused)
    assert all(_views_its_fused_weight(f) for f in fused)
    dtype = fused[0]._parts[0].dtype if quantization else torch.float32
    for f in fused:
        x = torch.randn(3, f.gemm.in_features, dtype=dtype)
        for got, part in zip(f(x), f._parts):
            torch.testing.assert_close(got, part(x))
