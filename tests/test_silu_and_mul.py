"""The dense SwiGLU's SiLU-and-mul kernel (dsaspec.ops.silu_and_mul) against plain torch, exactly:
bf16 and fp32, row counts 1 .. 129 around the 64 / 128 edges, the presets' feature widths (TP 1 and
their TP 8 shards) and odd ones, every bf16 gate value, the gate and up halves of one GEMM output,
outputs poisoned first, MLP and DSAModel choosing it with the Triton ops, the sm_90 compile.

Off the GPU the kernel's ``exp`` is numpy's fp32 ``exp`` (the interpreter cannot call libdevice),
and torch's CPU silu has its own vectorized ``exp`` that differs from numpy's in the last ulp of
some values; so here the reference is torch's formula and both of its roundings over numpy's
``exp`` values, and the GPU test (``-m gpu``) holds the kernel to ``F.silu(gate) * up`` itself.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from compile_scripts import compiled_counts
from dsaspec.configs.model_config import get_config
from dsaspec.ops.silu_and_mul import silu_and_mul

pytestmark = pytest.mark.interpreter

ROWS = (1, 2, 63, 64, 65, 127, 128, 129)
# tiny, tiny-moe's shared expert, bench, the glm5 / deepseek_v32 TP 8 shards of the dense FFN, odd widths
WIDTHS = (1, 7, 128, 512, 1000, 1025, 1536, 2304)
DTYPES = (torch.bfloat16, torch.float32)


def reference(gate: torch.Tensor, up: torch.Tensor, exp=None) -> torch.Tensor:
    """``silu(gate) * up`` as torch computes it: ``g / (1 + exp(-g))`` in fp32 rounded to the
    dtype, times ``up`` in fp32, rounded again. ``exp``: fp32 tensor -> fp32 tensor (default:
    numpy's, the interpreter's)."""
    g = gate.float()
    e = torch.from_numpy(np.exp(-g.cpu().numpy())).to(g.device) if exp is None else exp(-g)
    s = (g / (1.0 + e)).to(gate.dtype)
    return (s.float() * up.float()).to(gate.dtype)


def _gemm_output(rows: int, width: int, dtype, seed: int, scale: float = 4.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2 * width, generator=gen) * scale).to(dtype)


@pytest.fixture(autouse=True)
def _quiet_numpy():
    with np.errstate(over="ignore", invalid="ignore"):   # exp(-g) of large negative g is inf; -inf / inf
        yield


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", WIDTHS)
def test_gemm_halves_bit_for_bit(width, dtype, device):
    """The two column halves of one ``[T, 2I]`` GEMM output (row stride 2I), every row count; the
    output poisoned with NaN first, so an element left unwritten cannot equal the reference."""
    for rows in ROWS:
        gate_up = _gemm_output(rows, width, dtype, seed=rows * 7919 + width).to(device)
        gate, up = gate_up.split(width, dim=-1)
        out = torch.full((rows, width), float("nan"), dtype=dtype, device=device)
        assert silu_and_mul(gate, up, out) is out
        want = reference(gate, up)
        assert torch.equal(out, want), (rows, width)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_bf16_gate_value(dtype, device):
    """Every finite bf16 bit pattern and +inf as the gate (denormals, +-0, the largest magnitudes),
    against up values of several magnitudes; NaN and -inf (NaN out) beside them."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    gate = bits.view(torch.bfloat16).float()
    gate = torch.cat((gate[torch.isfinite(gate)], torch.tensor([float("inf")])))
    for up_value in (1.0, -3.140625, 1e-30, 3e38):
        up = torch.full_like(gate, up_value)
        g, u = gate.to(dtype).to(device)[None, :], up.to(dtype).to(device)[None, :]
        assert torch.equal(silu_and_mul(g, u), reference(g, u)), up_value
    nan = torch.tensor([[float("nan"), float("-inf"), 1.0]], dtype=dtype, device=device)
    out = silu_and_mul(nan, torch.ones_like(nan))       # -inf / (1 + inf) is NaN in torch too
    assert torch.isnan(out[0, :2]).all() and out[0, 2] == reference(nan, torch.ones_like(nan))[0, 2]


def test_separate_inputs_and_a_strided_output(device):
    """Gate and up as separate tensors (the unfused projections), the output a column slice of a
    wider buffer: its other columns untouched."""
    gate = _gemm_output(65, 700, torch.bfloat16, seed=1)[:, :700].contiguous().to(device)
    up = _gemm_output(65, 700, torch.bfloat16, seed=2)[:, 700:].contiguous().to(device)
    buffer = torch.full((65, 1000), 123.0, dtype=torch.bfloat16, device=device)
    silu_and_mul(gate, up, buffer[:, 100:800])
    assert torch.equal(buffer[:, 100:800], reference(gate, up))
    assert (buffer[:, :100] == 123.0).all() and (buffer[:, 800:] == 123.0).all()
    fresh = silu_and_mul(gate, up)
    assert fresh.is_contiguous() and torch.equal(fresh, buffer[:, 100:800])


def test_a_row_alone_matches_its_batch(device):
    gate, up = _gemm_output(129, 1536, torch.bfloat16, seed=5).to(device).split(1536, dim=-1)
    batch = silu_and_mul(gate, up)
    for r in (0, 64, 128):
        assert torch.equal(silu_and_mul(gate[r:r + 1], up[r:r + 1]), batch[r:r + 1])


def test_mlp_and_model_choose_the_kernel(monkeypatch):
    """MLP runs the kernel when ``use_triton`` (DSAModel sets it with its Triton ops, the MoE
    layers' shared experts included) and ``F.silu(gate) * up`` otherwise."""
    import dsaspec.ops.silu_and_mul as module
    from dsaspec.layers.mlp import MLP
    from dsaspec.models.dsa_model import DSAModel

    calls = []

    def counted(gate, up, out=None):
        calls.append(gate.shape)
        return silu_and_mul(gate, up, out)

    monkeypatch.setattr(module, "silu_and_mul", counted)
    model = DSAModel(get_config("tiny-moe"), dtype=torch.float32, use_triton=True).init_weights(0)
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    assert mlps and all(m.use_triton for m in mlps)
    dense = mlps[0]
    x = torch.randn(3, model.config.hidden_size)
    got = dense(x)
    assert calls == [(3, dense.gate_proj.out_features)]
    model.use_triton = False
    assert not any(m.use_triton for m in mlps)
    gate, up = dense.gate_up(x)
    assert torch.equal(dense(x), dense.down_proj(F.silu(gate) * up))
    assert torch.equal(got, dense.down_proj(reference(gate, up)))


def test_bad_inputs(device):
    gate = torch.zeros(3, 8, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="gate: expected dtype"):
        silu_and_mul(gate.half(), gate.half())
    with pytest.raises(ValueError, match="gate: expected 2 dimensions"):
        silu_and_mul(gate[0], gate[0])
    with pytest.raises(ValueError, match="gate: the last dimension must be contiguous"):
        silu_and_mul(gate.t(), gate.t())
    with pytest.raises(ValueError, match="up: expected dtype"):
        silu_and_mul(gate, gate.float())
    with pytest.raises(ValueError, match="up: expected shape"):
        silu_and_mul(gate, gate[:2])
    with pytest.raises(ValueError, match="out: expected shape"):
        silu_and_mul(gate, gate, torch.empty(3, 9, dtype=torch.bfloat16, device=device))
    with pytest.raises(TypeError, match="gate: expected a torch.Tensor"):
        silu_and_mul([[0.0]], gate)
    assert silu_and_mul(gate[:0], gate[:0]).shape == (0, 8)


@pytest.mark.gpu
def test_gpu_bit_for_bit_with_torch_cuda():
    """On the GPU, against ``F.silu(gate) * up`` on CUDA (torch's silu_kernel and multiply): every
    bf16 gate value, then every row count and width above, bf16 and fp32."""
    device = torch.device("cuda")
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    every = bits.view(torch.bfloat16).float()
    every = every[~torch.isnan(every) & (every != float("-inf"))]
    for dtype in DTYPES:
        for up_value in (1.0, -3.140625, 1e-30, 3e38):
            g = every.to(dtype).to(device)[None, :]
            u = torch.full_like(g, up_value)
            assert torch.equal(silu_and_mul(g, u), F.silu(g) * u), (dtype, up_value)
        for width in WIDTHS:
            for rows in ROWS + (512,):
                for scale in (4.0, 40.0):
                    gate, up = _gemm_output(rows, width, dtype, seed=rows + width, scale=scale).to(device).split(
                        width, dim=-1)
                    out = torch.full((rows, width), float("nan"), dtype=dtype, device=device)
                    assert torch.equal(silu_and_mul(gate, up, out), F.silu(gate) * up), (dtype, rows, width)


def test_compiles_for_sm90():
    """Without a GPU: bf16 and fp32 compile for sm_90 without spilled registers, with libdevice's
    ``expf`` (its range reduction's rounding constant 0x4B400001, not ``tl.exp``'s bare ``ex2``) and
    IEEE division only; scripts/compile_decode_epilogues.py's compile, in a subprocess."""
    rows = compiled_counts("compile_decode_epilogues", "(c.compile_silu_and_mul(bf16) for bf16 in (True, False))",
                           ("regs", "spill", "expf_calls", "div_rn", "div_approx"))
    assert len(rows) == 2
    for r in rows:
        assert 0 < r["regs"] <= 255 and r["spill"] == 0 and r["div_approx"] == 0, r
        assert 0 < r["expf_calls"] == r["div_rn"], r
