"""Row-invariant GEMM and norms (``dsaspec.ops.row_invariant``).

Two kinds of checks:

* Closeness to the fp64 reference (``dsaspec.reference.row_invariant``): fp32 within rtol = atol =
  1e-5 (fp32 accumulation of O(1) terms, K <= 600 on CPU; 1e-4 at K = 6144 on the GPU); bf16 within
  rtol = atol = 2**-6 = 1.6e-2 (two bf16 roundings, the reference's and the op's; the interpreter's
  fp32 -> bf16 cast truncates, so up to 1.5 ulp apart).
* Row invariance, bitwise: the op on ``x[:M]`` for many M, on single rows and on shuffled row
  subsets gives every row exactly the bits of that row in the op on all rows, with NaN, inf and
  huge rows beside it. The CPU interpreter runs small shapes (K, N <= 600ish, few M) with
  configurations of large tiles so few programs run; the production shapes and every M of 1..256
  are GPU tests.
* RMSNorms writing the FP8 GEMM's input too: codes and scales bitwise ``act_quant`` of the
  stored output (both scale formats, with and without the residual add, zero / NaN / inf rows),
  the output and residual bitwise the calls without them.
"""

from __future__ import annotations

import math

import pytest
import torch

from compile_scripts import integer_rows, run_in_scripts
from dsaspec.ops import device as device_facts, fp8_gemm
from dsaspec.ops import row_invariant as ri
from dsaspec.reference import fp8_gemm as fp8_ref
from dsaspec.reference import row_invariant as ref

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-6, atol=2**-6)}
DTYPES = [torch.float32, torch.bfloat16]
POISON = {5: math.nan, 18: math.inf, 30: -1e30}  # rows whose neighbours must not notice them
GPU_MS = (1, 2, 3, 4, 5, 8, 16, 17, 31, 32, 33, 64, 100, 128, 256)

# The interpreter's numpy warns on the poisoned rows' inf * inf and NaN arithmetic.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def _randn(*shape, dtype, device, seed=0, scale=1.0, poison=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * scale
    for row, value in (poison or {}).items():
        if row < shape[0]:
            x[row] = value
    return x.to(dtype).to(device)


def _assert_close(got, want, dtype):
    torch.testing.assert_close(got.double(), want.double(), **TOL[dtype])


def _assert_row_invariant(op, x, ms, alone, seed=0, poison=POISON):
    """``op`` maps rows ``[R, ...]`` to rows ``[R, ...]``. Every clean row of ``op(x[:M])``,
    ``op(x[i:i+1])`` and ``op(x[perm])`` equals, bitwise, that row of ``op(x)``."""
    rows = x.shape[0]
    full = op(x)
    clean = torch.tensor([r not in poison for r in range(rows)])
    for i in alone:
        assert torch.equal(op(x[i:i + 1])[0], full[i]), f"row {i} alone differs from row {i} of {rows}"
    for m in ms:
        got = op(x[:m])
        keep = clean[:m].to(got.device)
        assert torch.equal(got[keep], full[:m][keep]), f"M={m}: rows differ from M={rows}"
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(rows, generator=gen)[: max(1, (2 * rows) // 3)]
    got = op(x[perm.to(x.device)])
    keep = clean[perm].to(got.device)
    assert torch.equal(got[keep], full[perm.to(x.device)][keep]), "shuffled row subset differs"


# -------------------------------------------------------------------------------------------------
# linear


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (3, 16, 16), (17, 200, 100), (2, 600, 65)])
def test_linear_default_config_matches_reference(dtype, m, k, n, device):
    x = _randn(m, k, dtype=dtype, device=device)
    w = _randn(n, k, dtype=dtype, device=device, seed=1, scale=k ** -0.5)
    _assert_close(ri.linear(x, w), ref.linear(x, w), dtype)


SPLIT = ri.GemmConfig(16, 128, 128, 3, 4, 1)  # K = 576: 5 K blocks -> 3 splits of 2, 2, 1 blocks
WHOLE = ri.GemmConfig(16, 256, 64, 1, 4, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [SPLIT, WHOLE], ids=["split3", "split1"])
def test_linear_row_invariant(dtype, config, device):
    k, n = 576, 200
    x = _randn(40, k, dtype=dtype, device=device, poison=POISON)
    w = _randn(n, k, dtype=dtype, device=device, seed=1, scale=k ** -0.5)

    def op(rows):
        return ri.linear(rows, w, config=config)

    clean = [r for r in range(40) if r not in POISON]
    _assert_close(op(x)[clean], ref.linear(x[clean], w), dtype)
    _assert_row_invariant(op, x, ms=(3, 17, 33), alone=(0, 16, 39))


@pytest.mark.parametrize("dtype,k,n", [(torch.bfloat16, 576, 1031), (torch.float32, 200, 100)])
def test_linear_default_config_row_invariant_odd_sizes(dtype, k, n, device):
    """The default configuration (a split K in both cases) at K and N off the block sizes."""
    assert ri.gemm_config(n, k, dtype, device).split_k > 1
    x = _randn(16, k, dtype=dtype, device=device)
    w = _randn(n, k, dtype=dtype, device=device, seed=2, scale=k ** -0.5)
    full = ri.linear(x, w)
    assert torch.equal(ri.linear(x[15:16], w), full[15:16])


def test_linear_writes_only_its_region_and_reads_strided_rows(device):
    dtype = torch.bfloat16
    m, k, n = 5, 96, 70
    x_big = _randn(m, k + 8, dtype=dtype, device=device)
    w_big = _randn(n, k + 24, dtype=dtype, device=device, seed=1, scale=k ** -0.5)
    x, w = x_big[:, 4:4 + k], w_big[:, :k]
    out_big = torch.full((m + 2, n + 6), 3.0, dtype=dtype, device=device)
    out = out_big[1:1 + m, 2:2 + n]
    config = ri.GemmConfig(16, 64, 32, 2, 4, 1)
    assert ri.linear(x, w, out, config=config) is out
    _assert_close(out, ref.linear(x, w), dtype)
    out_big[1:1 + m, 2:2 + n] = 3.0
    assert torch.all(out_big == 3.0), "a write outside out[:M, :N]"


def test_linear_split_launches_repeat_and_leave_counters_zero(device):
    """A split-K launch resets its tile counters: repeated and differently tiled launches still
    write every output (into a poisoned buffer) with the same bits."""
    dtype = torch.float32
    k = 256
    x = _randn(20, k, dtype=dtype, device=device)
    w = _randn(48, k, dtype=dtype, device=device, seed=1)
    config = ri.GemmConfig(16, 32, 32, 4, 4, 1)
    first = ri.linear(x, w, config=config)
    for rows in (20, 3, 20):
        out = torch.full((rows, 48), math.nan, dtype=dtype, device=device)
        ri.linear(x[:rows], w, out, config=config)
        assert torch.equal(out, first[:rows])
    assert not device_facts._counters[x.device].any()


def test_linear_split_launch_beyond_the_counters_is_refused(monkeypatch, device):
    monkeypatch.setattr(device_facts, "COUNTER_CAPACITY", 2)
    x, w = torch.ones(40, 64, device=device), torch.ones(16, 64, device=device)
    with pytest.raises(ValueError, match="3 output tiles exceeds the 2 tile counters"):
        ri.linear(x, w, config=ri.GemmConfig(16, 16, 16, 2, 4, 1))


@pytest.mark.parametrize("m,k,n", [(0, 32, 16), (4, 0, 16), (4, 32, 0)])
def test_linear_empty(m, k, n, device):
    x = torch.ones(m, k, device=device)
    w = torch.ones(n, k, device=device)
    out = torch.full((m, n), math.nan, device=device)
    ri.linear(x, w, out)
    assert torch.equal(out, torch.zeros(m, n, device=device))


# -------------------------------------------------------------------------------------------------
# bmm: the absorbed MLA products, with the model's strided views


def _absorbed(rows, heads, nope, rope, latent, v, dtype, device, poison=None):
    """q_nope ``[R, H, nope]`` (a view of q), W_UK ``[H, nope, latent]`` (a view, N contiguous),
    W_UV^T ``[H, latent, v]`` (a transposed view, K contiguous), o_latent ``[R, H, latent]``."""
    q = _randn(rows, heads, nope + rope, dtype=dtype, device=device, poison=poison)
    kv_b = _randn(heads, nope + v, latent, dtype=dtype, device=device, seed=1, scale=latent ** -0.5)
    o_latent = _randn(rows, heads, latent, dtype=dtype, device=device, seed=2, poison=poison)
    return q[..., :nope], kv_b[:, :nope], kv_b[:, nope:].transpose(1, 2), o_latent


@pytest.mark.parametrize("dtype", DTYPES)
def test_bmm_absorbed_views_match_reference_and_are_row_invariant(dtype, device):
    q_nope, w_uk, w_uv_t, o_latent = _absorbed(20, 3, 40, 8, 48, 24, dtype, device, poison=POISON)

    def absorb(rows):  # [R, H, nope] -> [R, H, latent], out a strided view like the model's q_mqa
        out = torch.empty(rows.shape[0], rows.shape[1], 48 + 8, dtype=dtype, device=device)
        return ri.bmm(rows.transpose(0, 1), w_uk, out[..., :48].transpose(0, 1)).transpose(0, 1)

    def unabsorb(rows):  # [R, H, latent] -> [R, H, v]
        return ri.bmm(rows.transpose(0, 1), w_uv_t).transpose(0, 1)

    clean = [r for r in range(20) if r not in POISON]
    _assert_close(absorb(q_nope)[clean], ref.bmm(q_nope[clean].transpose(0, 1), w_uk).transpose(0, 1), dtype)
    _assert_close(unabsorb(o_latent)[clean], ref.bmm(o_latent[clean].transpose(0, 1), w_uv_t).transpose(0, 1),
                  dtype)
    _assert_row_invariant(absorb, q_nope, ms=(2, 17), alone=(0, 19))
    _assert_row_invariant(unabsorb, o_latent, ms=(2, 17), alone=(0, 19))


def test_bmm_split_k_matches_reference(device):
    dtype = torch.float32
    a = _randn(2, 19, 100, dtype=dtype, device=device)
    b = _randn(2, 100, 40, dtype=dtype, device=device, seed=1, scale=0.1)
    got = ri.bmm(a, b, config=ri.GemmConfig(16, 32, 32, 4, 4, 1))
    _assert_close(got, ref.bmm(a, b), dtype)


# -------------------------------------------------------------------------------------------------
# norms


def _norm_ops(dtype, d, device):
    w = _randn(d, dtype=dtype, device=device, seed=3) + 1
    b = _randn(d, dtype=dtype, device=device, seed=4)
    return [(lambda x: ri.rms_norm(x, w, 1e-6), lambda x: ref.rms_norm(x, w, 1e-6)),
            (lambda x: ri.layer_norm(x, w, b, 1e-5), lambda x: ref.layer_norm(x, w, b, 1e-5))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 7, 128, 576, 9000])
def test_norms_match_reference(dtype, d, device):
    x = _randn(3, d, dtype=dtype, device=device, scale=3.0) + 1
    for op, want in _norm_ops(dtype, d, device):
        _assert_close(op(x), want(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_row_invariant(dtype, device):
    d = 520
    x = _randn(20, d, dtype=dtype, device=device, scale=3.0, poison=POISON)
    for op, _ in _norm_ops(dtype, d, device):
        _assert_row_invariant(op, x, ms=(1, 3, 17), alone=(0, 19))


def test_norms_strided_rows_and_out(device):
    dtype = torch.bfloat16
    x = _randn(4, 576, dtype=dtype, device=device)[:, :512]  # the kv latent: a view of the projection
    w = _randn(512, dtype=dtype, device=device, seed=1)
    out_big = torch.full((4, 600), 5.0, dtype=dtype, device=device)
    assert ri.rms_norm(x, w, 1e-6, out=out_big[:, 8:520]).data_ptr() == out_big[:, 8:].data_ptr()
    _assert_close(out_big[:, 8:520], ref.rms_norm(x, w, 1e-6), dtype)
    assert torch.all(out_big[:, :8] == 5.0) and torch.all(out_big[:, 520:] == 5.0)
    assert ri.layer_norm(x[:0], w, w, 1e-5).shape == (0, 512)


def _add_inputs(m, d, dtype, device):
    x = _randn(m, d, dtype=dtype, device=device, scale=3.0, seed=5)
    residual = _randn(m, d, dtype=dtype, device=device, scale=2.0, seed=6) + 1
    return x, residual, _randn(d, dtype=dtype, device=device, seed=7) + 1


def _check_add_rms_norm(m, d, dtype, device):
    x, residual, w = _add_inputs(m, d, dtype, device)
    y, s = ri.add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(s, x + residual), f"M={m} D={d}: the new residual is not torch's x + residual"
    assert torch.equal(y, ri.rms_norm(x + residual, w, 1e-6)), f"M={m} D={d}: not the unfused norm's bits"
    want_y, want_s = ref.add_rms_norm(x, residual, w, 1e-6)
    _assert_close(y, want_y, dtype)
    assert torch.equal(s, want_s)


@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("d", [1, 7, 577, 9000])
def test_add_rms_norm_is_add_then_rms_norm_bitwise(m, d, device):
    """fp32 here (the interpreter truncates fp32 -> bf16 where torch rounds); bf16 on the GPU."""
    _check_add_rms_norm(m, d, torch.float32, device)


def test_add_rms_norm_row_invariant_strided_and_out(device):
    dtype, d = torch.float32, 520
    x, residual, w = _add_inputs(20, d, dtype, device)
    x[5] = math.nan

    def op(rows):  # rows: [x | residual]
        return torch.cat(ri.add_rms_norm(rows[:, :d], rows[:, d:], w, 1e-6), dim=-1)

    _assert_row_invariant(op, torch.cat((x, residual), dim=-1), ms=(1, 3, 17), alone=(0, 19), poison={5: math.nan})
    big = _randn(4, d + 64, dtype=dtype, device=device)
    out, res_out = torch.full((4, d), 5.0, device=device), torch.full((4, d + 8), 5.0, device=device)
    y, s = ri.add_rms_norm(big[:, :d], residual[:4], w, 1e-6, out=out, residual_out=res_out[:, 8:])
    assert y.data_ptr() == out.data_ptr() and s.data_ptr() == res_out[:, 8:].data_ptr()
    assert torch.equal(s, big[:, :d] + residual[:4]) and torch.all(res_out[:, :8] == 5.0)
    assert torch.equal(y, ri.rms_norm(big[:, :d] + residual[:4], w, 1e-6))
    empty_y, empty_s = ri.add_rms_norm(x[:0], residual[:0], w, 1e-6)
    assert empty_y.shape == empty_s.shape == (0, d)


# -------------------------------------------------------------------------------------------------
# RMSNorms that also write act_quant of their output (the FP8 GEMM's codes and scales)


def _quant_norm_inputs(m, d, dtype, device, seed):
    """``x``, ``residual``, ``weight`` ``[m, d]`` / ``[d]``: weights of another magnitude in each
    128-column group, row 1 all zero in both (the amax floor), row 2 with a NaN (a NaN row: every
    group's scale NaN, codes 0), row 3 with an inf at column 200 (a NaN there after the norm:
    group 1's scale NaN, the other groups zero)."""
    x = _randn(m, d, dtype=torch.float32, device="cpu", seed=seed, scale=3.0)
    residual = _randn(m, d, dtype=torch.float32, device="cpu", seed=seed + 1)
    for row, col, value in ((2, 5, math.nan), (3, 200, math.inf)):
        if row < m:
            x[row, col] = value
    if m > 1:
        x[1] = residual[1] = 0.0
    weight = _randn(d, dtype=torch.float32, device="cpu", seed=seed + 2) * 0.2 + 1
    weight *= torch.exp2(torch.arange(d) // 128 % 9 - 4.0)
    return x.to(dtype).to(device), residual.to(dtype).to(device), weight.to(dtype).to(device)


def _norm_quant(x, residual, w, fmt, **out):
    """rms_norm / add_rms_norm (``residual`` None or not) writing codes and scales into buffers
    poisoned with NaN: ``(y, s or None, codes, scales)``."""
    m, d = x.shape
    codes = torch.full((m, d + 128), 0x7F, dtype=torch.uint8, device=x.device).view(torch.float8_e4m3fn)[:, :d]
    scales = torch.full((m, d // 128), math.nan, device=x.device)
    fp8 = dict(q_out=codes, scale_out=scales, scale_fmt=fmt)
    if residual is None:
        return ri.rms_norm(x, w, 1e-6, **fp8, **out), None, codes, scales
    return *ri.add_rms_norm(x, residual, w, 1e-6, **fp8, **out), codes, scales


def _check_norm_quant(m, d, dtype, fmt, add, device, seed=0):
    """The codes and scales are bitwise act_quant's of the stored output (and the reference's);
    the output and the new residual are bitwise the calls without quantization."""
    x, residual, w = _quant_norm_inputs(m, d, dtype, device, seed)
    y, s, codes, scales = _norm_quant(x, residual if add else None, w, fmt)
    if add:
        want_y, want_s = ri.add_rms_norm(x, residual, w, 1e-6)
        assert torch.equal(s.view(torch.uint8), want_s.view(torch.uint8)), "the residual changed"
    else:
        want_y = ri.rms_norm(x, w, 1e-6)
    assert torch.equal(y.view(torch.uint8), want_y.view(torch.uint8)), "the normed output changed"
    want_codes, want_scales = fp8_gemm.act_quant(y, fmt)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)), "codes differ from act_quant's"
    assert torch.equal(scales.view(torch.int32), want_scales.view(torch.int32)), "scales differ from act_quant's"
    ref_codes, ref_scales = fp8_ref.act_quant(y.cpu(), fmt)
    assert torch.equal(codes.view(torch.uint8).cpu(), ref_codes.view(torch.uint8))
    assert torch.equal(scales.isnan().cpu(), ref_scales.isnan())
    assert torch.equal(scales.cpu()[~ref_scales.isnan()], ref_scales[~ref_scales.isnan()])
    return scales, codes


# the NaN rows' reductions under the interpreter
_ALL_NAN = pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")


@_ALL_NAN
@pytest.mark.parametrize("fmt", [None, "ue8m0"])
@pytest.mark.parametrize("add", [False, True], ids=["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("dtype,m,d", [(torch.bfloat16, 1, 128), (torch.bfloat16, 7, 640),
                                       (torch.float32, 5, 384), (torch.bfloat16, 3, 8320)],
                         ids=["bf16-1x128", "bf16-7x640", "fp32-5x384", "bf16-3x8320"])
def test_norm_quant_is_act_quant_of_the_output(dtype, m, d, add, fmt, device):
    """D 640: one 1024-column block with 3 masked 128-column groups; 8320: two passes of 8192."""
    scales, codes = _check_norm_quant(m, d, dtype, fmt, add, device, seed=m + d)
    if m > 3:
        floor = torch.tensor(1e-4, dtype=torch.float32) / 448.0
        if fmt == "ue8m0":
            floor = torch.exp2(torch.ceil(torch.log2(floor)))
        assert torch.equal(scales[1].cpu(), floor.expand(d // 128)) and not codes[1].float().any(), "zero row"
        assert scales[2].isnan().all() and not codes[2].float().any(), "a NaN row: NaN scales, zero codes"
        assert scales[3, 1].isnan() and not codes[3, 128:256].float().any(), "a NaN group: NaN scale, zero codes"
        assert torch.equal(scales[3, [0, 2]].cpu(), floor.expand(2)), "the inf row's other groups are zero"
        assert torch.isfinite(scales[[0, 4]]).all()


@_ALL_NAN
def test_norm_quant_rows_are_row_invariant_and_strided(device):
    """A row's codes and scales do not depend on the other rows (rows alone, a prefix); strided
    rows in and out, the codes' row stride too."""
    d = 384
    x, residual, w = _quant_norm_inputs(9, d, torch.bfloat16, device, seed=3)
    wide = torch.cat((x, torch.full_like(x, math.nan)), dim=-1)[:, :d]
    out = torch.full((9, d + 64), 5.0, dtype=torch.bfloat16, device=device)[:, :d]
    full = _norm_quant(wide, residual, w, "ue8m0", out=out)
    assert full[0].data_ptr() == out.data_ptr()
    for rows in (slice(0, 1), slice(4, 5), slice(0, 6)):
        part = _norm_quant(x[rows], residual[rows], w, "ue8m0")
        for got, want in zip(part, full):
            assert torch.equal(got.view(torch.uint8), want[rows].view(torch.uint8)), f"rows {rows} differ"


def test_norm_rows_split_over_programs_keep_their_bits(device):
    """Up to two programs per SM (132 off-GPU) split each row's outputs over 1024-column programs, more
    take one program a row: rows 0..2 of a 133-row call equal a 3-row call's bitwise (D 1536: the
    second program's columns half masked), the residual, output, codes and scales."""
    d = 1536
    x, residual, w = _quant_norm_inputs(133, d, torch.bfloat16, device, seed=11)
    full = _norm_quant(x, residual, w, "ue8m0")
    part = _norm_quant(x[:3], residual[:3], w, "ue8m0")
    for got, want in zip(part, full):
        assert torch.equal(got.view(torch.uint8), want[:3].view(torch.uint8))


def test_norm_quant_kernels_compile_for_sm90_without_spills():
    """Without a GPU: the input norm (residual add, hidden 6144) and q_a_layernorm (2048) writing
    the FP8 codes compile for sm_90 with no spills (scripts/compile_decode_epilogues.py, in a
    subprocess; 7168 and 1536 compile to the same kernels: the same BLOCK)."""
    out = run_in_scripts("compile_decode_epilogues",
                         "for d, add in ((6144, True), (2048, False)):\n"
                         "    r = c.compile_rms_norm(d, add, True)\n"
                         "    print(r['regs'], r['spill'])")
    rows = integer_rows(out)
    assert len(rows) == 2 and all(0 < regs <= 255 and spilled == 0 for regs, spilled in rows), out


# -------------------------------------------------------------------------------------------------
# configuration and argument errors


def test_default_configs_on_132_sms():
    """The tile and split choices at the GLM-5 decode shapes (132 SMs: the H200, and the CPU)."""
    cpu = torch.device("cpu")
    bf16 = torch.bfloat16
    expected = {  # (K, N): split_k;  bf16 tiles are 16 x 64 x 128
        (6144, 2048): 8, (6144, 576): 24, (2048, 16384): 1, (6144, 4096): 4, (4096, 6144): 2,
        (6144, 154880): 1,
    }
    for (k, n), split in expected.items():
        assert ri.gemm_config(n, k, bf16, cpu) == ri.GemmConfig(16, 64, 128, split, 4, 4), (k, n)
    assert ri.gemm_config(512, 192, bf16, cpu, batch=64).split_k == 1
    assert ri.gemm_config(64, 6144, torch.float32, cpu) == ri.GemmConfig(16, 32, 32, 32, 4, 3)


def _t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


@pytest.mark.parametrize("call,match", [
    (lambda: ri.linear(_t(4, 8), _t(5, 8, dtype=torch.bfloat16)), "weight: expected dtype"),
    (lambda: ri.linear(_t(4, 8), _t(5, 9)), "weight: expected shape"),
    (lambda: ri.linear(_t(2, 4, 8), _t(5, 8)), "x: expected 2 dimensions"),
    (lambda: ri.linear(_t(4, 8, dtype=torch.float16), _t(5, 8, dtype=torch.float16)), "x: expected dtype"),
    (lambda: ri.linear(_t(4, 8), _t(5, 8), _t(4, 6)), r"out: expected shape \(4, 5\)"),
    (lambda: ri.linear(_t(4, 8), _t(5, 8), _t(4, 5, dtype=torch.bfloat16)), "out: expected dtype"),
    (lambda: ri.linear(_t(4, 8), _t(8, 5).t()), "weight: the last dimension must be contiguous"),
    (lambda: ri.linear(_t(8, 4).t(), _t(5, 8)), "x: the last dimension must be contiguous"),
    (lambda: ri.bmm(_t(4, 8), _t(5, 8, 3)), "a: expected 3 dimensions"),
    (lambda: ri.bmm(_t(2, 4, 8), _t(3, 8, 5)), r"b: expected shape \(2, 8, \*\)"),
    (lambda: ri.bmm(_t(2, 4, 8), _t(2, 8, 5, dtype=torch.bfloat16)), "b: expected dtype"),
    (lambda: ri.bmm(_t(2, 4, 8), _t(2, 8, 5), _t(2, 5, 4)), r"out: expected shape \(2, 4, 5\)"),
    (lambda: ri.rms_norm(_t(8), _t(8), 1e-6), "x: expected 2 dimensions"),
    (lambda: ri.rms_norm(_t(4, 8), _t(7), 1e-6), r"weight: expected shape \(8,\)"),
    (lambda: ri.rms_norm(_t(4, 8), _t(8, dtype=torch.bfloat16), 1e-6), "weight: expected dtype"),
    (lambda: ri.rms_norm(_t(4, 0), _t(0), 1e-6), "x: expected at least one column"),
    (lambda: ri.rms_norm(_t(4, 8), _t(8), 1e-6, out=_t(3, 8)), r"out: expected shape \(4, 8\)"),
    (lambda: ri.layer_norm(_t(4, 8), _t(8), None, 1e-5), "bias: expected a tensor"),
    (lambda: ri.add_rms_norm(_t(4, 8), None, _t(8), 1e-6), "residual: expected a tensor"),
    (lambda: ri.add_rms_norm(_t(4, 8), _t(3, 8), _t(8), 1e-6), r"residual: expected shape \(4, 8\)"),
    (lambda: ri.add_rms_norm(_t(4, 8), _t(4, 8), _t(8), 1e-6, residual_out=_t(4, 7)),
     r"residual_out: expected shape \(4, 8\)"),
    (lambda: (lambda r: ri.add_rms_norm(_t(4, 8), r, _t(8), 1e-6, residual_out=r))(_t(4, 8)),
     "residual_out: must not share storage"),
    (lambda: ri.layer_norm(_t(4, 8), _t(8), _t(9), 1e-5), r"bias: expected shape \(8,\)"),
    (lambda: ri.rms_norm(_t(4, 128), _t(128), 1e-6, q_out=_t(4, 128, dtype=torch.float8_e4m3fn)),
     "q_out, scale_out: expected both"),
    (lambda: ri.rms_norm(_t(4, 64), _t(64), 1e-6, q_out=_t(4, 64, dtype=torch.float8_e4m3fn), scale_out=_t(4, 1)),
     "x: D = 64 must be a multiple of 128"),
    (lambda: ri.rms_norm(_t(4, 128), _t(128), 1e-6, q_out=_t(4, 128), scale_out=_t(4, 1)), "q_out: expected dtype"),
    (lambda: ri.add_rms_norm(_t(4, 256), _t(4, 256), _t(256), 1e-6, q_out=_t(4, 256, dtype=torch.float8_e4m3fn),
                             scale_out=_t(4, 1)), r"scale_out: expected shape \(4, 2\)"),
    (lambda: ri.rms_norm(_t(4, 128), _t(128), 1e-6, q_out=_t(4, 128, dtype=torch.float8_e4m3fn), scale_out=_t(4, 1),
                         scale_fmt="e8m0"), "scale_fmt: expected one of"),
    (lambda: ri.GemmConfig(16, 48, 64, 1, 4, 1), "config.block_n"),
    (lambda: ri.GemmConfig(8, 64, 64, 1, 4, 1), "config.block_m"),
    (lambda: ri.GemmConfig(16, 64, 64, 0, 4, 1), "config.split_k"),
])
def test_bad_arguments_name_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# -------------------------------------------------------------------------------------------------
# GPU: production shapes, every M of 1..256


GLM5_LINEAR = [(6144, 2048), (6144, 576), (2048, 16384), (6144, 4096), (4096, 6144), (6144, 154880)]


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", GLM5_LINEAR)
def test_gpu_linear_glm5_shapes_row_invariant(k, n):
    dtype, device = torch.bfloat16, torch.device("cuda")
    x = _randn(256, k, dtype=dtype, device=device, poison=POISON)
    w = _randn(n, k, dtype=dtype, device=device, seed=1, scale=k ** -0.5)
    clean = [r for r in range(256) if r not in POISON]
    _assert_close(ri.linear(x, w)[clean], ref.linear(x[clean], w), dtype)
    _assert_row_invariant(lambda rows: ri.linear(rows, w), x, ms=GPU_MS, alone=(0, 1, 15, 16, 17, 100, 255))


@pytest.mark.gpu
def test_gpu_linear_fp32_head_weights_row_invariant():
    """The indexer's fp32 ``weights_proj`` (hidden 6144 -> 64 heads), and an fp32 K=576, N=1031."""
    device = torch.device("cuda")
    for k, n in ((6144, 64), (576, 1031)):
        x = _randn(256, k, dtype=torch.float32, device=device, poison=POISON)
        w = _randn(n, k, dtype=torch.float32, device=device, seed=1, scale=k ** -0.5)
        clean = [r for r in range(256) if r not in POISON]
        torch.testing.assert_close(ri.linear(x, w)[clean].double(), ref.linear(x[clean], w).double(),
                                   rtol=1e-4, atol=1e-4)
        _assert_row_invariant(lambda rows: ri.linear(rows, w), x, ms=GPU_MS, alone=(0, 17, 255))


@pytest.mark.gpu
def test_gpu_bmm_absorbed_heads_row_invariant():
    dtype, device = torch.bfloat16, torch.device("cuda")
    q_nope, w_uk, w_uv_t, o_latent = _absorbed(256, 64, 192, 64, 512, 256, dtype, device, poison=POISON)

    def absorb(rows):
        return ri.bmm(rows.transpose(0, 1), w_uk).transpose(0, 1)

    def unabsorb(rows):
        return ri.bmm(rows.transpose(0, 1), w_uv_t).transpose(0, 1)

    clean = [r for r in range(256) if r not in POISON]
    _assert_close(absorb(q_nope)[clean], ref.bmm(q_nope[clean].transpose(0, 1), w_uk).transpose(0, 1), dtype)
    _assert_close(unabsorb(o_latent)[clean],
                  ref.bmm(o_latent[clean].transpose(0, 1), w_uv_t).transpose(0, 1), dtype)
    _assert_row_invariant(absorb, q_nope, ms=GPU_MS, alone=(0, 17, 255))
    _assert_row_invariant(unabsorb, o_latent, ms=GPU_MS, alone=(0, 17, 255))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [128, 512, 2048, 6144, 16384])
def test_gpu_norms_row_invariant(dtype, d):
    device = torch.device("cuda")
    x = _randn(256, d, dtype=dtype, device=device, scale=3.0, poison=POISON)
    clean = [r for r in range(256) if r not in POISON]
    for op, want in _norm_ops(dtype, d, device):
        _assert_close(op(x)[clean], want(x[clean]), dtype)
        _assert_row_invariant(op, x, ms=GPU_MS, alone=(0, 17, 255))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [7, 577, 6144, 9000])
def test_gpu_add_rms_norm_is_add_then_rms_norm_bitwise(dtype, d):
    device = torch.device("cuda")
    for m in GPU_MS:
        _check_add_rms_norm(m, d, dtype, device)
    x, residual, w = _add_inputs(256, d, dtype, device)
    _assert_row_invariant(lambda rows: torch.cat(ri.add_rms_norm(rows[:, :d], rows[:, d:], w, 1e-6), -1),
                          torch.cat((x, residual), dim=-1), ms=GPU_MS, alone=(0, 17, 255), poison={})


@pytest.mark.gpu
@_ALL_NAN
@pytest.mark.parametrize("d", [1536, 2048, 6144, 7168])
def test_gpu_norm_quant_is_act_quant_of_the_output(d):
    """The q latent (DeepSeek-V3.2, GLM-5) and hidden widths, bf16, every row count of GPU_MS:
    codes and scales bitwise act_quant's of the stored output, the output and residual unchanged."""
    for m in GPU_MS:
        for fmt in (None, "ue8m0"):
            for add in (False, True):
                _check_norm_quant(m, d, torch.bfloat16, fmt, add, torch.device("cuda"), seed=m)


@pytest.mark.gpu
def test_gpu_split_linear_in_cuda_graph_matches_eager():
    """A split-K launch replayed from a CUDA graph (counters reset on every replay) gives the eager bits."""
    device = torch.device("cuda")
    k, n = 6144, 576
    x = _randn(16, k, dtype=torch.bfloat16, device=device)
    w = _randn(n, k, dtype=torch.bfloat16, device=device, seed=1, scale=k ** -0.5)
    assert ri.gemm_config(n, k, torch.bfloat16, device).split_k > 1
    eager = ri.linear(x, w)
    out = torch.full_like(eager, math.nan)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        ri.linear(x, w, out)
    for _ in range(3):
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
