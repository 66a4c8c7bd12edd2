"""``dsaspec.ops.absorb_v.absorb_v_quant`` against ``dsaspec.reference.absorb_v``.

* Exact: inputs whose fp32 sums are exact in any order (small integers times powers of two) give
  the reference's bf16 values, codes and scales bit for bit on the GPU; under the interpreter,
  whose fp32 -> bf16 cast truncates, the exact sums truncated, and the act_quant of those.
* Random inputs: the values within the fp32 summation error of the fp64 sums plus one bf16
  rounding; the codes and scales always bitwise the reference ``act_quant`` of the op's own values.
* A row's results do not depend on the other rows; every output row is written (poisoned by
  NaN-filled allocations would show); bad arguments raise errors naming them.
"""

from __future__ import annotations

import pytest
import torch

from compile_scripts import integer_rows, run_in_scripts
from dsaspec.ops.absorb_v import absorb_v_quant
from dsaspec.reference import absorb_v as ref
from dsaspec.reference.fp8_gemm import act_quant as ref_act_quant

# (R, H, V, L): one head / block, GLM-5's rank (8 heads of V 256), DeepSeek-V3.2's (V 128), rows
# across the 16-row tiles
SHAPES = [(1, 1, 128, 64), (3, 2, 256, 128), (16, 8, 256, 512), (17, 3, 128, 192), (33, 2, 384, 64)]


def _exact_inputs(rows, heads, v, latent, device, seed):
    """Values in {-3 .. 3} * 2**e (e in -2 .. 2): every partial sum of <= 512 products is an exact fp32."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        ints = torch.randint(-3, 4, shape, generator=gen).float()
        return (ints * torch.exp2(torch.randint(-2, 3, shape, generator=gen).float())).bfloat16().to(device)

    return draw(rows, heads, latent), draw(heads, v, latent)


def _truncated_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` cast to bf16 by dropping its low 16 bits (the interpreter's cast)."""
    return (x.float().view(torch.int32) & -65536).view(torch.float32).bfloat16()


def _bits(t):
    return t.view(torch.uint8 if t.element_size() == 1 else torch.int16 if t.element_size() == 2 else torch.int32).cpu()


@pytest.mark.parametrize("fmt", [None, "ue8m0"])
@pytest.mark.parametrize("rows,heads,v,latent", SHAPES)
def test_exact_sums_equal_the_reference_bitwise(rows, heads, v, latent, fmt, device):
    o_latent, w_uv = _exact_inputs(rows, heads, v, latent, device, seed=rows * heads + v)
    got = absorb_v_quant(o_latent, w_uv, fmt)
    want = ref.absorb_v_quant(o_latent.cpu(), w_uv.cpu(), fmt)
    if not o_latent.is_cuda:
        exact = torch.einsum("rhl,hvl->rhv", o_latent.double(), w_uv.double()).reshape(rows, -1)
        o = _truncated_bf16(exact.float())
        want = (o, *ref_act_quant(o, fmt))
    for name, g, w in zip(("o", "codes", "scales"), got, want):
        assert g.shape == w.shape, name
        assert torch.equal(_bits(g), _bits(w)), f"{name} differs"


@pytest.mark.parametrize("fmt", [None, "ue8m0"])
@pytest.mark.parametrize("rows,heads,v,latent", SHAPES[1:3])
def test_random_values_within_fp32_error_and_codes_of_them(rows, heads, v, latent, fmt, device):
    gen = torch.Generator().manual_seed(7)
    o_latent = torch.randn(rows, heads, latent, generator=gen).bfloat16().to(device)
    w_uv = (torch.randn(heads, v, latent, generator=gen) / latent ** 0.5).bfloat16().to(device)
    o, codes, scales = absorb_v_quant(o_latent, w_uv, fmt)
    exact = torch.einsum("rhl,hvl->rhv", o_latent.double().cpu(), w_uv.double().cpu()).reshape(rows, -1)
    magnitude = torch.einsum("rhl,hvl->rhv", o_latent.double().abs().cpu(), w_uv.double().abs().cpu()).reshape(rows, -1)
    bound = latent * 2.0 ** -24 * magnitude + 2.0 ** -7 * exact.abs()   # fp32 sums, one bf16 rounding
    assert torch.all((o.double().cpu() - exact).abs() <= bound), "values off the fp32 sums"
    want_codes, want_scales = ref_act_quant(o.cpu(), fmt)
    assert torch.equal(_bits(codes), _bits(want_codes)), "codes are not act_quant of the values"
    assert torch.equal(_bits(scales), _bits(want_scales)), "scales are not act_quant's"


def test_a_row_does_not_depend_on_the_other_rows(device):
    gen = torch.Generator().manual_seed(3)
    o_latent = torch.randn(33, 2, 128, generator=gen).bfloat16().to(device)
    w_uv = torch.randn(2, 256, 128, generator=gen).bfloat16().to(device)
    full = absorb_v_quant(o_latent, w_uv, "ue8m0")
    for row in (0, 16, 32):
        alone = absorb_v_quant(o_latent[row:row + 1].clone(), w_uv, "ue8m0")
        for name, f, a in zip(("o", "codes", "scales"), full, alone):
            assert torch.equal(_bits(f[row:row + 1]), _bits(a)), f"row {row}: {name} depends on the batch"


def test_every_row_is_written_over_poisoned_memory(device):
    # the allocator hands back the NaN-filled blocks just freed: unwritten outputs would keep them
    o_latent, w_uv = _exact_inputs(17, 2, 128, 64, device, seed=5)
    for _ in range(2):
        poison = [torch.full((17, 256), float("nan"), dtype=torch.bfloat16, device=device),
                  torch.full((17, 256), float("nan"), dtype=torch.float32, device=device)]
        del poison
        o, codes, scales = absorb_v_quant(o_latent, w_uv, None)
        assert not o.isnan().any() and not scales.isnan().any() and not codes.float().isnan().any()


def test_zero_rows_return_empty_outputs(device):
    o, codes, scales = absorb_v_quant(torch.empty(0, 2, 64, dtype=torch.bfloat16, device=device),
                                      torch.zeros(2, 128, 64, dtype=torch.bfloat16, device=device), None)
    assert o.shape == codes.shape == (0, 256) and scales.shape == (0, 2)


@pytest.mark.parametrize("o_shape,w_shape,dtype,fmt,match", [
    ((2, 2, 64), (2, 100, 64), torch.bfloat16, None, "w_uv: V = 100"),
    ((2, 2, 96), (2, 128, 96), torch.bfloat16, None, "o_latent: L = 96"),
    ((2, 2, 64), (3, 128, 64), torch.bfloat16, None, r"w_uv: expected shape \(2, V, 64\)"),
    ((2, 2, 64), (2, 128, 64), torch.float32, None, "o_latent"),
    ((2, 2, 64), (2, 128, 64), torch.bfloat16, "e8m0", "scale_fmt"),
])
def test_bad_arguments_are_named(o_shape, w_shape, dtype, fmt, match, device):
    with pytest.raises(ValueError, match=match):
        absorb_v_quant(torch.zeros(o_shape, dtype=dtype, device=device),
                       torch.zeros(w_shape, dtype=torch.bfloat16, device=device), fmt)


def test_compiles_for_sm90_on_tensor_cores_without_spills():
    """Without a GPU: the kernel at the TP 8 ranks' shapes, 1 and 64 rows, compiles for sm_90 with
    bf16 tensor-core MMAs (the dot not upcast) and no spills (scripts/compile_decode_epilogues.py,
    in a subprocess)."""
    out = run_in_scripts("compile_decode_epilogues",
                         "for heads, v in c.ABSORB_SHAPES:\n"
                         "    for rows in c.ROW_COUNTS:\n"
                         "        r = c.compile_absorb_v(heads, v, rows)\n"
                         "        mma = sum(n for op, n in r['sass'].items()\n"
                         "                  if op.startswith('HMMA') and 'BF16' in op)\n"
                         "        local = sum(n for op, n in r['sass'].items() if op.startswith(('LDL', 'STL')))\n"
                         "        print(r['regs'], r['spill'], local, mma)")
    results = integer_rows(out)
    assert len(results) == 4, out
    for regs, spilled, local, mma in results:
        assert 0 < regs <= 128 and spilled == 0 and local == 0 and mma > 0, out


@pytest.mark.gpu
@pytest.mark.parametrize("heads,v", [(8, 256), (16, 128)])
@pytest.mark.parametrize("rows", [1, 4, 32, 64])
def test_rank_shapes_gpu(rows, heads, v):
    """GLM-5's and DeepSeek-V3.2's TP 8 rank (L 512): exact sums bitwise, the W_UV view's strides."""
    o_latent, w = _exact_inputs(rows, heads, v + 192, 512, "cuda", seed=rows)
    w_uv = w[:, 192:]                               # kv_b_proj's value rows after the key rows
    got = absorb_v_quant(o_latent, w_uv, "ue8m0")
    want = ref.absorb_v_quant(o_latent.cpu(), w_uv.cpu(), "ue8m0")
    for name, g, wt in zip(("o", "codes", "scales"), got, want):
        assert torch.equal(_bits(g), _bits(wt)), f"{name} differs"


class _Stop(Exception):
    pass


def test_attention_hands_o_proj_the_absorption_codes():
    """MLAAttention (tiny with V 128 a head, FP8 linears, bf16) with the Triton ops: the value
    absorption runs once as ``absorb_v_quant`` and ``o_proj`` multiplies its codes; the layer's
    output is the bmm-then-quantize path's within one bf16 rounding of ``o`` (the interpreter's
    cast truncates where torch.bmm rounds to nearest) carried through ``o_proj``."""
    from types import SimpleNamespace

    from dsaspec.configs.model_config import get_config
    from dsaspec.configs.quantization import Fp8Quantization
    from dsaspec.distributed.tp_group import TPGroup
    from dsaspec.layers.attention.dsa_ops import dsa_ops
    from dsaspec.layers.attention.mla import MLAAttention
    from dsaspec.layers.fp8_convert import convert_to_fp8
    from dsaspec.layers.fp8_linear import Fp8Linear
    from dsaspec.ops.fp8_gemm import quantize_weight

    gen = torch.Generator().manual_seed(4)
    config = get_config("tiny", v_head_dim=128)
    attn = MLAAttention(config, 1, TPGroup.single(), dtype=torch.bfloat16)
    convert_to_fp8(attn, Fp8Quantization())
    for module in attn.modules():
        if isinstance(module, Fp8Linear):
            w, s = quantize_weight(torch.randn(module.weight.shape, generator=gen) * 0.1)
            module.weight.data.copy_(w)
            module.weight_scale_inv.data.copy_(s)
    for name, param in attn.named_parameters():
        if param.dtype == torch.bfloat16:
            param.data.copy_(torch.randn(param.shape, generator=gen) * 0.1 + (1.0 if param.dim() == 1 else 0.0))
    attn.fuse_projections()
    assert attn.output_quant is not None
    rows = 3
    x = torch.randn(rows, config.hidden_size, generator=gen).bfloat16()
    o_latent = torch.randn(rows, attn.num_heads, config.kv_lora_rank, generator=gen).bfloat16()
    calls = []

    def attend(q, cache, slots, scale, out, **kwargs):   # the attention's output, fixed
        out.copy_(o_latent)

    def counted(q_latent, w_uv, scale_fmt):
        calls.append(q_latent.shape)
        return absorb_v_quant(q_latent, w_uv, scale_fmt)

    outputs = []
    for fused in (True, False):
        ops = SimpleNamespace(**vars(dsa_ops(True, False)))
        ops.sparse_mla_decode = attend
        ops.absorb_v_quant = counted if fused else None
        step = SimpleNamespace(cos=torch.ones(rows, 32), sin=torch.zeros(rows, 32),
                               out_cache_loc=torch.tensor([1, 4, 6]), ops=ops, check_values=True, seeded=True, selected=None,
                               attn=SimpleNamespace(workspace=None))
        with torch.no_grad():
            outputs.append(attn(x, step, torch.zeros(8, 576, dtype=torch.bfloat16), None).float())
    assert calls == [(rows, attn.num_heads, config.kv_lora_rank)]
    fused, unfused = outputs
    scale = unfused.abs().amax()
    assert not torch.equal(fused, torch.zeros_like(fused))
    torch.testing.assert_close(fused, unfused, rtol=0, atol=float(scale) * 2.0 ** -4)
