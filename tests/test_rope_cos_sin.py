"""The RoPE table kernel (dsaspec.ops.rope_cos_sin) against Rotary's torch ops, bit for bit: the
presets' frequencies (and a YaRN factor that is not 1), positions 0, 1, 2**k +- 1 up to 2**20,
each preset's maximum context and a dense run; every edge row count; a row's bits independent of
the batch; Rotary and DSAModel choosing it with the Triton ops; the sm_90 compile.

Under the interpreter the kernel's fp64 cos / sin are numpy's and the torch ops' are torch's CPU
ones: measured over every position 0 .. 2**20 + 1 with the frequencies of glm5, glm52,
deepseek_v32 and tiny (33,554,496 angles each), numpy and torch differ in 59,750 - 64,509 of the
fp64 values (0.18 - 0.19 %), always by one ulp, and in none of the fp32 results (with the factor
1 of every preset and with YaRN's 1.3688879454113936): an fp64 ulp moves the fp32 rounding only
next to a tie. So the tests ask for exact equality here too; on the GPU both sides are libdevice.
"""

import pytest
import torch

from compile_scripts import run_in_scripts
from dsaspec.configs.model_config import get_config
from dsaspec.layers.rotary import Rotary, rope_inv_freq
from dsaspec.ops.rope_cos_sin import rope_cos_sin

pytestmark = pytest.mark.interpreter

YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
        "mscale_all_dim": 0.0}
CONFIGS = {name: get_config(name) for name in ("glm5", "glm52", "deepseek_v32", "tiny")}
CONFIGS["deepseek_v32_yarn_factor"] = get_config("deepseek_v32").replace(rope_scaling=YARN)
EDGE_ROWS = [0, 1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 256]


def _positions(config) -> torch.Tensor:
    """0, 1, 2**k +- 1 (k <= 20), 2**20, the preset's last position and the largest context of
    any preset (glm52, bench, e2e: 2**20 tokens), in no particular order."""
    powers = [2 ** k + d for k in range(1, 21) for d in (-1, 0, 1)]
    ends = [config.max_position_embeddings - 1, config.max_position_embeddings, 2 ** 20 - 1, 2 ** 20]
    return torch.tensor(sorted(set([0, 1] + powers + ends)), dtype=torch.int64).flip(0)


def _torch_tables(config, positions):
    rotary = Rotary(config, positions.device)
    assert not rotary.use_triton
    return rotary(positions)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_positions_bit_for_bit(name, device):
    config = CONFIGS[name]
    inv_freq, factor = rope_inv_freq(config)
    assert (factor != 1.0) == (name == "deepseek_v32_yarn_factor")
    positions = _positions(config).to(device)
    cos, sin = rope_cos_sin(positions, inv_freq.to(device), factor)
    want_cos, want_sin = _torch_tables(config, positions)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (positions.shape[0], 32)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


@pytest.mark.parametrize("name", ["glm52", "deepseek_v32_yarn_factor"])
def test_dense_positions_bit_for_bit(name, device):
    """4096 consecutive positions at the start and at the end of a 2**20-token context."""
    config = CONFIGS[name]
    inv_freq, factor = rope_inv_freq(config)
    positions = torch.cat((torch.arange(4096), torch.arange(2 ** 20 - 4096, 2 ** 20))).to(device)
    got = rope_cos_sin(positions, inv_freq.to(device), factor)
    want = _torch_tables(config, positions)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("rows", EDGE_ROWS)
def test_edge_rows_and_batch_independence(rows, device):
    """Every edge row count (up to 32 rows a program), int32 and strided positions alike, and a row's
    bits alone those it has in the batch."""
    config = CONFIGS["deepseek_v32_yarn_factor"]
    inv_freq, factor = rope_inv_freq(config)
    inv_freq = inv_freq.to(device)
    gen = torch.Generator().manual_seed(rows)
    wide = torch.randint(0, 2 ** 20, (2 * rows,), generator=gen).to(device)
    positions = wide[::2]
    cos, sin = rope_cos_sin(positions, inv_freq, factor)
    want_cos, want_sin = _torch_tables(config, positions)
    assert cos.shape == sin.shape == (rows, 32)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    as_int32 = rope_cos_sin(positions.to(torch.int32), inv_freq, factor)
    assert torch.equal(as_int32[0], cos) and torch.equal(as_int32[1], sin)
    for r in sorted({0, rows // 2, rows - 1}) if rows else ():
        alone = rope_cos_sin(positions[r:r + 1], inv_freq, factor)
        assert torch.equal(alone[0], cos[r:r + 1]) and torch.equal(alone[1], sin[r:r + 1])


def test_rotary_and_model_choose_the_kernel(monkeypatch):
    """Rotary runs the kernel when ``use_triton`` (DSAModel sets it with its Triton ops) and the
    torch ops otherwise, with the same tables."""
    import dsaspec.ops.rope_cos_sin as module
    from dsaspec.models.dsa_model import DSAModel

    calls = []

    def counted(*args):
        calls.append(args)
        return rope_cos_sin(*args)

    monkeypatch.setattr(module, "rope_cos_sin", counted)
    config = CONFIGS["tiny"]
    positions = torch.tensor([5, 0, 4095])
    rotary = Rotary(config)
    want = rotary(positions)
    rotary.use_triton = True
    got = rotary(positions)
    assert len(calls) == 1 and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    model = DSAModel(config, device="cpu", use_triton=True)
    assert model.rotary.use_triton
    model.use_triton = False
    assert not model.rotary.use_triton


def test_bad_inputs(device):
    inv_freq = torch.ones(32, dtype=torch.float64, device=device)
    positions = torch.zeros(3, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="positions: expected dtype"):
        rope_cos_sin(positions.float(), inv_freq, 1.0)
    with pytest.raises(ValueError, match="positions: expected 1 dimensions"):
        rope_cos_sin(positions[:, None], inv_freq, 1.0)
    with pytest.raises(ValueError, match="inv_freq: expected dtype"):
        rope_cos_sin(positions, inv_freq.float(), 1.0)
    with pytest.raises(TypeError, match="factor: expected a float"):
        rope_cos_sin(positions, inv_freq, torch.tensor(1.0))
    empty = rope_cos_sin(positions[:0], inv_freq, 1.0)
    assert empty[0].shape == empty[1].shape == (0, 32)


@pytest.mark.gpu
def test_gpu_bit_for_bit_with_torch_cuda():
    """On the GPU, against Rotary's torch ops on CUDA (fp64 cos / sin of the CUDA math library):
    every position 0 .. 2**20 + 1 and each preset's maximum context, every preset's frequencies
    and the YaRN factor; edge row counts."""
    device = torch.device("cuda")
    for name, config in CONFIGS.items():
        inv_freq, factor = rope_inv_freq(config)
        for positions in (torch.arange(2 ** 20 + 2, device=device), _positions(config).to(device)):
            got = rope_cos_sin(positions, inv_freq.to(device), factor)
            want = _torch_tables(config, positions)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
    for rows in EDGE_ROWS:
        test_edge_rows_and_batch_independence(rows, device)


def test_compiles_for_sm90():
    """Without a GPU: the kernel compiles for sm_90 (fp64 cos / sin by libdevice, whose slow
    argument reduction keeps a local array: a stack frame, not a register spill) without spilled
    registers; scripts/compile_decode_epilogues.py's compile, in a subprocess."""
    out = run_in_scripts("compile_decode_epilogues",
                         "r = c.compile_rope_cos_sin()\n"
                         "print(r['regs'], r['spill'], r['libdevice_calls'])")
    regs, spilled, calls = map(int, out.split()[-3:])
    assert 0 < regs <= 255 and spilled == 0 and calls > 0, out
