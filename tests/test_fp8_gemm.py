"""FP8 block-scaled ops (``dsaspec.ops.fp8_gemm``) against ``dsaspec.reference.fp8_gemm``.

* Quantizers, bitwise: the scales' fp32 bit patterns and the e4m3 codes equal the reference's,
  on the CPU too (the kernel rounds to the e4m3 grid before its cast, so the interpreter's inexact
  cast never rounds).
* GEMM, within the fp32-accumulation tolerance: ``|y - ref| <= 2 K 2**-24 (|A| |W|^T)`` (fp32
  accumulation of K products, elementwise bound) plus, for a bf16 output, ``2**-7 |ref|`` (one bf16
  ulp: the op's rounding, RNE on the GPU, truncation under the interpreter); A and W are the
  dequantized codes the op itself multiplies.
* Non-finite activations: a 128-column group holding NaN or +-inf gets scale NaN and codes 0, and
  its row's outputs are all NaN; the other rows are unaffected.
* K groups: the split form (a program per K group, fp32 partials that the tile's last program to
  finish adds) gives the unsplit form's bits, so a row's bits do not depend on M across the split
  threshold. Off the GPU the SM count is patched (``_sms``) to get 1 to 5 groups of 1 or 3 blocks,
  with a partial last group (``k_group``), on shapes the interpreter runs in seconds. The kernels
  compile for sm_90 without spills (offline, in a subprocess).
"""

from __future__ import annotations

import math

import pytest
import torch

from compile_scripts import integer_rows, run_in_scripts
from dsaspec.forward_mode import PREFILL_MIN_ROWS
from dsaspec.ops import device as device_facts, fp8_gemm as op
from dsaspec.reference import fp8_gemm as ref

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

FMTS = [None, "ue8m0"]


def _activations(m, k, dtype, device, seed=0):
    """Per-group magnitudes over 2**-20 .. 2**20, one all-zero group, values at powers of two."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    groups = x.view(m, k // 128, 128)
    groups *= torch.exp2(torch.randint(-20, 21, (m, k // 128, 1), generator=gen).float())
    if m * k >= 256:
        groups.view(-1, 128)[1] = 0.0
        groups.view(-1, 128)[0, 7] = 448.0 * 4  # amax / 448 exactly a power of two
    return x.to(dtype).to(device)


def _bits_equal(a, b):
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _codes_equal(a, b):
    return torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu())


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k", [(1, 128), (2, 256), (3, 384), (8, 128), (16, 256), (17, 1024), (40, 128)])
def test_act_quant_matches_reference_bitwise(m, k, dtype, fmt, device):
    x = _activations(m, k, dtype, device, seed=m + k)
    q, s = op.act_quant(x, fmt)
    want_q, want_s = ref.act_quant(x.cpu(), fmt)
    assert _bits_equal(s.cpu(), want_s), "scale bit patterns differ"
    assert _codes_equal(q, want_q), "e4m3 codes differ"
    if fmt == "ue8m0":
        mantissa, _ = torch.frexp(s.cpu())
        assert torch.all(mantissa == 0.5), "ue8m0 scales must be powers of two"


def test_act_quant_zero_group_uses_the_amax_floor(device):
    x = torch.zeros(2, 256, dtype=torch.bfloat16, device=device)
    x[1, 128:] = 1.0
    q, s = op.act_quant(x)
    assert s[0, 0].item() == torch.tensor(1e-4 / 448.0, dtype=torch.float32).item()
    assert _bits_equal(s[:1].cpu(), torch.full((1, 2), 1e-4, dtype=torch.float32) / 448.0)
    assert not q[0].float().any()


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_group_gives_nan_scale_and_nan_row(value, device):
    x = _activations(4, 256, torch.bfloat16, device, seed=3)
    x[2, 130] = value
    q, s = op.act_quant(x)
    want_q, want_s = ref.act_quant(x.cpu())
    assert math.isnan(s[2, 1].item()) and torch.isfinite(s[2, 0]) and torch.isfinite(s[[0, 1, 3]]).all()
    assert not q[2, 128:].float().any(), "codes of a non-finite group must be 0"
    assert _codes_equal(q, want_q)
    assert torch.equal(s.isnan().cpu(), want_s.isnan()) and _bits_equal(s.cpu()[~want_s.isnan()],
                                                                        want_s[~want_s.isnan()])
    w, ws = ref.quantize_weight(torch.randn(128, 256) / 16)
    y = op.fp8_gemm(q, s, w.to(device), ws.to(device))
    assert y[2].isnan().all(), "a row with a non-finite group must come out NaN"
    assert torch.isfinite(y[[0, 1, 3]]).all(), "the other rows must not notice"


def _weight(n, k, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / math.sqrt(k)
    w[: min(n, 128), :128] *= 1e-3                   # a block of small weights: its own scale
    return w.to(device)


def _check_gemm(y, a, a_s, w, w_s, fast_accum=False):
    """``y`` within the fp32-accumulation bound of the dequantized product (+ bf16 rounding of a bf16
    ``y``). ``fast_accum`` (64-row tiles on the GPU): the e4m3 warpgroup MMA sums each 128-column
    block in 4 instructions of 32 products, each keeping about 14 bits of the largest magnitude it
    meets (DeepSeek-V3's report, 3.3.2): 4 * 2^-13 = 2^-11 of the block's sum |a||w| a step,
    2^-8 allowed (measured: 2^-9.9, benchmarks/results/h200/logs/fp8_tall_tile_accuracy_session10.log)."""
    a_deq = ref.dequantize(a.cpu(), a_s.cpu(), 1)
    w_deq = ref.dequantize(w.cpu(), w_s.cpu(), 128)
    want = a_deq @ w_deq.T
    k = a.shape[1]
    bound = (2 * k * 2.0 ** -24 + (2.0 ** -8 if fast_accum else 0)) * (a_deq.abs() @ w_deq.abs().T)
    if y.dtype == torch.bfloat16:
        bound += 2.0 ** -7 * want.abs()
    err = (y.cpu().double() - want).abs()
    worst = (err - bound).max().item()
    assert worst <= 0, f"error exceeds the fp32-accumulation bound by {worst:.3g} (max err {err.max():.3g})"


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k", [(1, 64, 128), (2, 128, 256), (15, 200, 128), (16, 576, 256),
                                   (17, 130, 384), (33, 64, 512)])
def test_fp8_gemm_matches_reference(m, n, k, out_dtype, device):
    x = _activations(m, k, torch.bfloat16, device, seed=n)
    a, a_s = op.act_quant(x)
    w, w_s = ref.quantize_weight(_weight(n, k, "cpu"))
    # poison: the operands are views into larger buffers whose extra rows / columns hold NaN codes
    a_buf = torch.full((m + 16, k + 128), 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    a_buf[:m, :k] = a
    w_buf = torch.full((n + 64, k + 128), 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    w_buf[:n, :k] = w.to(device)
    out = torch.full((m, n), math.nan, dtype=out_dtype, device=device)
    y = op.fp8_gemm(a_buf[:m, :k], a_s, w_buf[:n, :k], w_s.to(device), out=out)
    assert y is out
    _check_gemm(y, a, a_s, w, w_s)


def test_fp8_gemm_rows_do_not_depend_on_the_batch(device):
    k, n = 256, 192
    a, a_s = op.act_quant(_activations(37, k, torch.bfloat16, device, seed=5))
    w, w_s = (t.to(device) for t in ref.quantize_weight(_weight(n, k, "cpu")))
    full = op.fp8_gemm(a, a_s, w, w_s)
    for rows in (slice(0, 1), slice(5, 6), slice(0, 17), slice(20, 37)):
        assert torch.equal(op.fp8_gemm(a[rows], a_s[rows], w, w_s), full[rows]), f"rows {rows} differ"


def test_fp8_linear_is_act_quant_then_gemm(device):
    x = _activations(5, 256, torch.bfloat16, device, seed=9)
    w, w_s = (t.to(device) for t in ref.quantize_weight(_weight(256, 256, "cpu")))
    for fmt in FMTS:
        a, a_s = ref.act_quant(x.cpu(), fmt)
        y = op.fp8_linear(x, w, w_s, fmt)
        assert y.dtype == torch.bfloat16
        _check_gemm(y, a, a_s, w, w_s)


def _linear(x, w, w_s, fmt, split=None):
    """fp8_linear of ``x``, its output in ``x``'s dtype."""
    y = op.fp8_linear(x, w, w_s, fmt, split=split)
    assert y.dtype == x.dtype
    return y


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m,k", [(m, k) for k in (128, 384) for m in (1, 2, 15, 16, 17, 64, 65, 256)]
                         + [(m, 7168) for m in (1, 16, 17, 65)])
def test_linear_of_strided_rows_within_tolerance(m, k, fmt, device):
    # strided rows: x is a column slice of a wider buffer whose extra columns are NaN
    x_buf = torch.full((m, k + 128), math.nan, dtype=torch.bfloat16, device=device)
    x_buf[:, :k] = _activations(m, k, torch.bfloat16, device, seed=m * k)
    x = x_buf[:, :k]
    n = 200 if k < 7168 else 72
    w, w_s = (t.to(device) for t in ref.quantize_weight(_weight(n, k, "cpu", seed=k)))
    y = _linear(x, w, w_s, fmt, split=False)   # long K loops; the split: test_linear_split_*
    _check_gemm(y, *ref.act_quant(x.cpu(), fmt), w, w_s)


def _sms(monkeypatch, sms):
    """Make the op plan for a device of ``sms`` SMs (k_group and the split threshold)."""
    monkeypatch.setattr(op, "sm_count", lambda device: sms)


# (N, K, SMs) -> G, groups: 1 group; 2 groups; 5 groups of 1 block; 3 groups of 3, 3, 1 blocks
# (a partial last group), N 130 (not a multiple of 64: a partial tile)
SPLIT_CASES = {(130, 384, 1): (3, 1), (130, 768, 3): (3, 2), (64, 640, 132): (1, 5), (130, 896, 5): (3, 3)}


def test_k_group_follows_the_shape_and_the_sms():
    """G of the TP 8 rank shapes on an H200 (132 SMs, SPLIT_PROGRAMS_PER_SM 2): at most 2 programs
    an SM per row block, unless the tiles alone are more."""
    rank_shapes = {(2752, 6144): 8, (2240, 7168): 8, (512, 6144): 2, (512, 7168): 2, (6144, 2048): 8,
                   (7168, 2048): 8, (6144, 256): 1, (7168, 256): 1, (3072, 1536): 3, (11264, 1536): 12}
    for (n, k), group in rank_shapes.items():
        assert op.k_group(n, k, 132) == group, (n, k)
        tiles, groups = -(-n // 64), -(-k // 128 // group)
        assert tiles * groups <= max(2 * 132, tiles), (n, k)
    for (n, k, sms), plan in SPLIT_CASES.items():
        assert (op.k_group(n, k, sms), -(-k // 128 // op.k_group(n, k, sms))) == plan


@pytest.mark.parametrize("m", [1, 2, 15, 16, 17, 40])
@pytest.mark.parametrize("n,k,sms", list(SPLIT_CASES))
def test_split_is_the_unsplit_form_bitwise(n, k, sms, m, monkeypatch, device):
    _sms(monkeypatch, sms)
    a, a_s = op.act_quant(_activations(m, k, torch.bfloat16, device, seed=m + k))
    w, w_s = (t.to(device) for t in ref.quantize_weight(_weight(n, k, "cpu", seed=n)))
    split = op.fp8_gemm(a, a_s, w, w_s, out_dtype=torch.float32, split=True)
    assert _bits_equal(split, op.fp8_gemm(a, a_s, w, w_s, out_dtype=torch.float32, split=False)), "split != unsplit"
    _check_gemm(split, a, a_s, w, w_s)
    if m == 17:                                   # bf16 out: the reduce's cast is the unsplit store's
        assert torch.equal(op.fp8_gemm(a, a_s, w, w_s, split=True), op.fp8_gemm(a, a_s, w, w_s, split=False))
    # every tile's last program stored its counter back to 0: a second call (a graph replay) reduces again
    assert not device_facts._counters[split.device].any(), "a split call left an arrival counter set"
    assert _bits_equal(op.fp8_gemm(a, a_s, w, w_s, out_dtype=torch.float32, split=True), split)


class _RecordedTiles:
    """Stands in for ``op._fp8_gemm_kernel``: launches the real kernel, keeping each launch's
    ``BLOCK_M`` and ``EARLY``."""

    def __init__(self, kernel):
        self.kernel, self.block_m, self.early = kernel, [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.block_m.append(kwargs["BLOCK_M"])
            self.early.append(kwargs["EARLY"])
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("m", [1, 31, 32, 65])
def test_fast_accum_takes_tall_tiles_from_their_threshold(m, monkeypatch, device):
    """``fast_accum`` takes 64-row tiles from TALL_TILE_MIN_M rows (both forms, the same bits,
    within their bound: _check_gemm); without it 16 at every M, so those rows equal the single-row
    results bitwise. 16-row programs load their last weight tile before the chain's wait (EARLY)
    where M spans more than one of them; the single-row results, without it, check its order."""
    recorded = _RecordedTiles(op._fp8_gemm_kernel)
    monkeypatch.setattr(op, "_fp8_gemm_kernel", recorded)
    n, k = 130, 384
    a, a_s = op.act_quant(_activations(m, k, torch.bfloat16, device, seed=m))
    w, w_s = (t.to(device) for t in ref.quantize_weight(_weight(n, k, "cpu", seed=2)))
    tall = 64 if m >= op.TALL_TILE_MIN_M else 16
    forms = [op.fp8_gemm(a, a_s, w, w_s, out_dtype=torch.float32, split=split, fast_accum=True)
             for split in (False, True)]
    assert recorded.block_m == [tall, tall] and op.tile_rows(m, True) == tall
    assert _bits_equal(forms[0], forms[1])
    _check_gemm(forms[0], a, a_s, w, w_s, fast_accum=tall == 64)
    exact = op.fp8_gemm(a, a_s, w, w_s, out_dtype=torch.float32)
    assert recorded.block_m[-1] == 16 and op.tile_rows(m, False) == 16
    assert recorded.early == [int(tall == 16 and m > 16)] * 2 + [int(m > 16)]
    for row in {0, m - 1}:
        assert _bits_equal(op.fp8_gemm(a[row:row + 1], a_s[row:row + 1], w, w_s, out_dtype=torch.float32),
                           exact[row:row + 1]), f"row {row} differs"


def test_fp8_linear_layer_passes_fast_accum_to_the_tiles(monkeypatch, device):
    """Fp8Linear with the Triton ops: 64-row tiles at 40 rows with ``fast_accum``, 16 without, for
    bf16 rows and for an Fp8Input's codes."""
    from dsaspec.layers.fp8_linear import Fp8Input, Fp8Linear

    recorded = _RecordedTiles(op._fp8_gemm_kernel)
    monkeypatch.setattr(op, "_fp8_gemm_kernel", recorded)
    layer = Fp8Linear(256, 128, device)
    layer.set_dense(_weight(128, 256, "cpu", seed=3))
    layer.use_triton = True
    x = _activations(40, 256, torch.bfloat16, device, seed=4)
    codes, scales = op.act_quant(x)
    for fast_accum, tile in ((True, 64), (False, 16)):
        layer.fast_accum = fast_accum
        layer(x)
        layer(Fp8Input(x, codes, scales, None))
        assert recorded.block_m[-2:] == [tile, tile], (fast_accum, recorded.block_m)


@pytest.mark.parametrize("row_invariant", [False, True])
def test_fp8_linear_layer_takes_tall_tiles_at_prefill_rows(row_invariant, monkeypatch, device):
    """Without ``fast_accum``, Fp8Linear takes the 64-row tiles from PREFILL_MIN_ROWS rows (one row
    fewer: 16), unless ``row_invariant`` (16 at every M, each row's bits those of its row alone); bf16
    rows and an Fp8Input's codes alike, within the tall tiles' bound."""
    from dsaspec.layers.fp8_linear import Fp8Input, Fp8Linear

    recorded = _RecordedTiles(op._fp8_gemm_kernel)
    monkeypatch.setattr(op, "_fp8_gemm_kernel", recorded)
    layer = Fp8Linear(256, 128, device)
    layer.set_dense(_weight(128, 256, "cpu", seed=5))
    layer.use_triton, layer.row_invariant = True, row_invariant
    x = _activations(PREFILL_MIN_ROWS, 256, torch.float32, device, seed=6)
    codes, scales = op.act_quant(x)
    tall = 16 if row_invariant else 64
    full = layer(x)
    layer(Fp8Input(x, codes, scales, None))
    layer(x[1:])
    assert recorded.block_m == [tall, tall, 16]
    _check_gemm(full, codes, scales, layer.weight, layer.weight_scale_inv, fast_accum=tall == 64)
    if row_invariant:
        assert _bits_equal(layer(x[-1:]), full[-1:])


def test_rows_do_not_depend_on_m_across_the_split_threshold(monkeypatch, device):
    """5 SMs, N 130 (3 tiles), K 896 (G 3): M 1 splits, M 40 (9 tiles) does not; its rows equal
    the M 1 results bitwise (fp32 activations and output: no bf16 rounding to hide a changed sum)."""
    _sms(monkeypatch, 5)
    n, k = 130, 896
    assert op.gemm_plan(1, n, k, device) == (3, 3, True) and not op.gemm_plan(40, n, k, device)[2]
    w, w_s = (t.to(device) for t in ref.quantize_weight(_weight(n, k, "cpu")))
    x = _activations(40, k, torch.float32, device, seed=11)
    full = op.fp8_linear(x, w, w_s)
    for row in (0, 17, 39):
        assert _bits_equal(op.fp8_linear(x[row:row + 1], w, w_s), full[row:row + 1]), f"row {row} differs"


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m", [1, 17])
def test_linear_split_is_the_unsplit_form_bitwise(m, fmt, monkeypatch, device):
    _sms(monkeypatch, 5)
    x_buf = torch.full((m, 1024), math.nan, dtype=torch.float32, device=device)   # strided rows
    x_buf[:, :896] = _activations(m, 896, torch.float32, device, seed=m)
    x = x_buf[:, :896]
    w, w_s = (t.to(device) for t in ref.quantize_weight(_weight(130, 896, "cpu")))
    y = _linear(x, w, w_s, fmt, split=True)
    assert torch.equal(y, op.fp8_linear(x, w, w_s, fmt, split=False)), "split != unsplit"
    _check_gemm(y, *ref.act_quant(x.cpu(), fmt), w, w_s)


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_split_non_finite_block_gives_a_nan_row(value, monkeypatch, device):
    """A non-finite value in the last, partial group of row 3: row 3 all NaN, split or not."""
    _sms(monkeypatch, 5)
    x = _activations(5, 896, torch.bfloat16, device, seed=7)
    x[3, 800] = value
    w, w_s = (t.to(device) for t in ref.quantize_weight(_weight(130, 896, "cpu")))
    y = _linear(x, w, w_s, None, split=True)
    assert y[3].isnan().all(), "a row with a non-finite block must come out NaN"
    assert torch.isfinite(y[[0, 1, 2, 4]]).all(), "the other rows must not notice"
    assert torch.equal(y.view(torch.int16), op.fp8_linear(x, w, w_s, split=False).view(torch.int16))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m", [3, 40])
def test_linear_fp32_activations_within_tolerance(m, fmt, device):
    x = _activations(m, 384, torch.float32, device, seed=m)
    w, w_s = (t.to(device) for t in ref.quantize_weight(_weight(130, 384, "cpu")))
    y = _linear(x, w, w_s, fmt)
    _check_gemm(y, *ref.act_quant(x.cpu(), fmt), w, w_s)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_linear_non_finite_block_gives_a_nan_row(value, device):
    x = _activations(5, 384, torch.bfloat16, device, seed=7)
    x[3, 300] = value
    w, w_s = (t.to(device) for t in ref.quantize_weight(_weight(100, 384, "cpu")))
    y = _linear(x, w, w_s, None)
    assert y[3].isnan().all(), "a row with a non-finite block must come out NaN"
    assert torch.isfinite(y[[0, 1, 2, 4]]).all(), "the other rows must not notice"


def test_fp8_linear_bad_arguments_are_named(device):
    x = torch.zeros(4, 256, dtype=torch.bfloat16, device=device)
    w = torch.zeros(128, 256, dtype=torch.float8_e4m3fn, device=device)
    w_s = torch.ones(1, 2, device=device)
    cases = [
        ((x.half(), w, w_s), {}, "x: expected dtype in"),
        ((x[:, :200], w[:, :200], w_s), {}, "x: K = 200 must be a positive multiple of 128"),
        ((x[:0], w, w_s), {}, r"x.shape\[0\] \(M\): expected >= 1"),
        ((x.t().contiguous().t(), w, w_s), {}, "x: the last dimension must be contiguous"),
        ((x, w, w_s, "e8m0"), {}, "scale_fmt: expected one of"),
        ((x, w[:, :128], w_s), {}, r"w: expected shape \(128, 256\)"),
        ((x, w.bfloat16(), w_s), {}, "w: expected dtype torch.float8_e4m3fn"),
        ((x, w, torch.ones(1, 3, device=device)), {}, r"w_scale: expected shape \(1, 2\)"),
        ((x, w, w_s), {"out": torch.empty(4, 64, dtype=torch.bfloat16, device=device)}, "out: expected shape"),
        ((x, w, w_s), {"out": torch.empty(4, 128, dtype=torch.float16, device=device)}, "out: expected dtype"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            op.fp8_linear(*args, **kwargs)


@pytest.mark.parametrize("n,k", [(128, 128), (200, 256), (576, 384), (64, 128)])
def test_quantize_weight_matches_reference_bitwise(n, k, device):
    w = _weight(n, k, "cpu", seed=n)
    w[-1, -128:] = 0.0
    if n > 128:
        w[128:, :128] = 0.0                           # an all-zero block: the amax floor
    q, s = op.quantize_weight(w.to(device))
    want_q, want_s = ref.quantize_weight(w)
    assert _bits_equal(s.cpu(), want_s) and _codes_equal(q, want_q)
    deq = op.dequantize_weight(q, s, torch.float32)
    assert torch.equal(deq.cpu(), ref.dequantize(want_q, want_s, 128).float())  # one rounding of an exact product


@pytest.mark.parametrize("fmt", FMTS)
def test_torch_quantize_blocks_is_act_quant(fmt):
    x = _activations(19, 384, torch.bfloat16, "cpu", seed=4)
    x[3, 5], x[7, 300] = math.nan, -math.inf
    q, s = op.quantize_blocks(x, 1, fmt)
    want_q, want_s = ref.act_quant(x, fmt)
    assert _codes_equal(q, want_q) and torch.equal(s.isnan(), want_s.isnan())
    assert _bits_equal(s[~s.isnan()], want_s[~want_s.isnan()])


def test_quantize_weight_refuses_non_finite_and_bad_k():
    with pytest.raises(ValueError, match="weight: holds NaN or infinite"):
        op.quantize_weight(torch.tensor([[math.inf] + [0.0] * 127]))
    with pytest.raises(ValueError, match="K = 100 must be a positive multiple of 128"):
        op.quantize_weight(torch.zeros(128, 100))


def test_bad_arguments_are_named(device):
    x = torch.zeros(4, 256, dtype=torch.bfloat16, device=device)
    a, a_s = op.act_quant(x)
    w = torch.zeros(128, 256, dtype=torch.float8_e4m3fn, device=device)
    w_s = torch.ones(1, 2, device=device)
    cases = [
        (lambda: op.act_quant(torch.zeros(4, 200, dtype=torch.bfloat16, device=device)),
         "x: K = 200 must be a positive multiple of 128"),
        (lambda: op.act_quant(x, "e8m0"), "scale_fmt: expected one of"),
        (lambda: op.act_quant(x.half()), "x: expected dtype in"),
        (lambda: op.act_quant(x[:0]), r"x.shape\[0\] \(M\): expected >= 1"),
        (lambda: op.act_quant(x, scale_out=torch.empty(4, 3, device=device)), "scale_out: expected shape"),
        (lambda: op.fp8_gemm(x, a_s, w, w_s), "a: expected dtype torch.float8_e4m3fn"),
        (lambda: op.fp8_gemm(a, a_s, w[:, :128], w_s), r"w: expected shape \(128, 256\)"),
        (lambda: op.fp8_gemm(a, a_s, w, torch.ones(2, 2, device=device)), r"w_scale: expected shape \(1, 2\)"),
        (lambda: op.fp8_gemm(a, a_s.double(), w, w_s), "a_scale: expected dtype torch.float32"),
        (lambda: op.fp8_gemm(a, a_s, w, w_s, out_dtype=torch.float16), "out_dtype: expected one of"),
        (lambda: op.fp8_gemm(a, a_s, w, w_s, out=torch.empty(4, 64, dtype=torch.bfloat16, device=device)),
         "out: expected shape"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 8, 16, 17, 64, 100, 256, 512])
@pytest.mark.parametrize("n,k", [(576, 7168), (2048, 6144), (7168, 2048), (16384, 512)])
def test_fp8_gemm_production_shapes_gpu(m, n, k):
    x = _activations(m, k, torch.bfloat16, "cuda", seed=m)
    a, a_s = op.act_quant(x, "ue8m0")
    want_q, want_s = ref.act_quant(x.cpu(), "ue8m0")
    assert _bits_equal(a_s.cpu(), want_s) and _codes_equal(a, want_q)
    w, w_s = (t.cuda() for t in op.quantize_weight(_weight(n, k, "cuda")))
    y = op.fp8_gemm(a, a_s, w, w_s)
    _check_gemm(y, a, a_s, w, w_s)
    assert torch.equal(op.fp8_gemm(a[:1], a_s[:1], w, w_s), y[:1]), "row 0 depends on the batch"
    fast = [op.fp8_gemm(a, a_s, w, w_s, split=split, fast_accum=True) for split in (False, True)]
    _check_gemm(fast[0], a, a_s, w, w_s, fast_accum=True)
    assert torch.equal(fast[0], fast[1]), "the fast-accumulation split form differs from the unsplit"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m", [1, 4, 16, 17, 64, 65, 256])
@pytest.mark.parametrize("n,k", [(576, 7168), (2048, 6144), (7168, 2048), (3072, 1536)])
def test_linear_production_shapes_gpu(m, n, k, fmt):
    x = _activations(m, k, torch.bfloat16, "cuda", seed=m + n)
    w, w_s = op.quantize_weight(_weight(n, k, "cuda"))
    y = _linear(x, w, w_s, fmt)
    _check_gemm(y, *ref.act_quant(x.cpu(), fmt), w, w_s)
    assert torch.equal(op.fp8_linear(x[:1], w, w_s, fmt), y[:1]), "row 0 depends on the batch"


def test_gemm_kernels_compile_for_sm90_without_spills():
    """Without a GPU: the GEMM unsplit and split (its in-kernel reduce) compile for sm_90 (GLM-5's
    fused attention input; chained as on an H200) with no register spills and within a block's
    shared memory (scripts/compile_fused_moe.py, in a subprocess)."""
    cases = [("gemm", split) for split in (False, True)]
    out = run_in_scripts("compile_fused_moe",
                         f"for kernel, split in {cases!r}:\n"
                         "    r = c.compile_fp8_linear(kernel, split)\n"
                         "    print(r['regs'], r['spill'], r['shared'], c.dsa.SM90_SHARED)")
    results = integer_rows(out)
    assert len(results) == len(cases), out
    for regs, spilled, shared, limit in results:
        assert 0 < regs <= 255 and spilled == 0 and shared <= limit, out


# (N, K) of the TP 8 rank FP8 GEMMs: GLM-5 fused_input, shared gate_up, o_proj / fused_latent, shared
# down; DeepSeek-V3.2 fused_input, fused_latent, q_b_proj, o_proj, shared gate_up, shared down
RANK_SHAPES = [(2752, 6144), (512, 6144), (6144, 2048), (6144, 256), (2240, 7168), (11264, 1536), (3072, 1536),
               (7168, 2048), (512, 7168), (7168, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 64, 128])
@pytest.mark.parametrize("n,k", RANK_SHAPES)
def test_split_production_shapes_gpu(m, n, k):
    x = _activations(m, k, torch.bfloat16, "cuda", seed=m + k)
    w, w_s = op.quantize_weight(_weight(n, k, "cuda"))
    a, a_s = op.act_quant(x, "ue8m0")
    split = op.fp8_gemm(a, a_s, w, w_s, out_dtype=torch.float32, split=True)
    assert _bits_equal(split, op.fp8_gemm(a, a_s, w, w_s, out_dtype=torch.float32, split=False)), "split != unsplit"
    _check_gemm(split, a, a_s, w, w_s)
    y = op.fp8_linear(x, w, w_s, "ue8m0")
    for split in (False, True):
        assert torch.equal(op.fp8_linear(x, w, w_s, "ue8m0", split=split), y), split
    assert torch.equal(op.fp8_linear(x[:1], w, w_s, "ue8m0"), y[:1]), "row 0 depends on the batch"


@pytest.mark.gpu
def test_split_cuda_graph_replay_gpu():
    """GLM-5's shared gate/up at M 4 (split, 24 groups, added by each tile's last program; a
    programmatic dependent of act_quant on sm_90), captured once and replayed on new rows: equal
    to eager calls."""
    n, k, m = 512, 6144, 4
    w, w_s = op.quantize_weight(_weight(n, k, "cuda"))
    x = _activations(m, k, torch.bfloat16, "cuda", seed=1)
    assert op.gemm_plan(m, n, k, x.device)[2], "expected the split form"
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    op.fp8_linear(x, w, w_s, "ue8m0", out=out)         # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op.fp8_linear(x, w, w_s, "ue8m0", out=out)
    for seed in (2, 3):
        x.copy_(_activations(m, k, torch.bfloat16, "cuda", seed=seed))
        out.fill_(math.nan)
        graph.replay()
        assert torch.equal(out, op.fp8_linear(x, w, w_s, "ue8m0")), f"replay {seed} != eager"
