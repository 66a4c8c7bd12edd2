"""The fused MLA latent epilogue and absorbed query (dsaspec.ops.mla_latent) and the indexer's
fused head weights (dsaspec.ops.index_weights) against the plain-torch references: RoPE and the
query exactly, the RMSNorm (its sum of squares in another order) to one ulp of the model dtype,
the FP8 write to one e4m3 step; the head weights (split over K) within a bound of the fp32 sums'
rounding at every edge row count, their K chunks and sm_90 compile; every row's bits independent
of the batch; MLAAttention's and the Indexer's Triton paths against their
torch paths, and the aten ops left on MLAAttention's Triton path."""

import collections

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from compile_scripts import run_in_scripts
from dsaspec.forward_mode import PREFILL_MIN_ROWS
from dsaspec.ops import device as device_facts
from dsaspec.ops.index_weights import index_weights, index_weights_splits
from dsaspec.ops.mla_latent import launch_mla_query, mla_query, mla_query_tiles, store_mla_normed
from dsaspec.reference.fp8_kv import read_mla, write_mla
from dsaspec.reference.mla_latent import reference_index_weights, reference_mla_latent, reference_mla_query

pytestmark = pytest.mark.interpreter

ROW_COUNTS = [1, 3, 17, 64]
EPS = 1e-6
POISON = 0xA5


def _inputs(rows, dtype, gen, device):
    kv = (torch.randn(rows, 576, generator=gen) * 2 + 0.5).to(dtype)
    w = (torch.rand(512, generator=gen) + 0.5).to(dtype)
    angles = torch.rand(rows, 32, generator=gen) * 100
    return kv.to(device), w.to(device), angles.cos().to(device), angles.sin().to(device)


def _ulps(dtype):
    """One unit in the last place, relative: the sum of squares may round the other way."""
    return 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                               (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_dense_cache(dtype, cache_dtype, interleaved, rows, device):
    """Written rows: the reference's rope key exactly, its latent to one ulp, rounded to the
    cache's dtype; the other slots untouched."""
    gen = torch.Generator().manual_seed(rows)
    kv, w, cos, sin = _inputs(rows, dtype, gen, device)
    slots = 2 * rows + 5
    loc = torch.randperm(slots, generator=gen)[:rows].to(device)
    cache = torch.full((slots, 576), 7.0, dtype=cache_dtype, device=device)
    store_mla_normed(cache, loc, kv, w, EPS, cos, sin, interleaved)
    want = reference_mla_latent(kv.cpu(), w.cpu(), EPS, cos.cpu(), sin.cpu(), interleaved).to(cache_dtype)
    cache = cache.cpu()
    got = cache[loc.cpu()]
    assert torch.equal(got[:, 512:], want[:, 512:])
    torch.testing.assert_close(got[:, :512].float(), want[:, :512].float(), rtol=_ulps(cache_dtype), atol=1e-6)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[loc.cpu()] = False
    assert torch.all(cache[untouched] == 7.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_fp8_cache(dtype, rows, device):
    """The reference rows quantized by the reference fp8_ds_mla write: the rope key's bytes
    exactly, the latent to one e4m3 step (a latent one ulp apart may round to the next code);
    other slots' bytes untouched."""
    gen = torch.Generator().manual_seed(rows + 50)
    kv, w, cos, sin = _inputs(rows, dtype, gen, device)
    slots = 2 * rows + 3
    loc = torch.randperm(slots, generator=gen)[:rows].to(device)
    cache = torch.full((slots, 656), POISON, dtype=torch.uint8, device=device)
    store_mla_normed(cache, loc, kv, w, EPS, cos, sin, True)
    want_rows = reference_mla_latent(kv.cpu(), w.cpu(), EPS, cos.cpu(), sin.cpu(), True)
    expected = write_mla(torch.full((slots, 656), POISON, dtype=torch.uint8), loc.cpu(), want_rows)
    cache = cache.cpu()
    assert torch.equal(cache[:, 528:], expected[:, 528:])
    got, want = read_mla(cache, loc.cpu()), read_mla(expected, loc.cpu())
    step = want[:, :512].abs().reshape(rows, 4, 128).amax(-1).repeat_interleave(128, dim=1) / 8
    assert torch.all((got[:, :512] - want[:, :512]).abs() <= step)
    assert (cache != expected).float().mean().item() < 0.01
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[loc.cpu()] = False
    assert torch.all(cache[untouched] == POISON)


@pytest.mark.parametrize("fp8", [False, True])
def test_latent_rows_independent_of_batch(fp8, device):
    """A row's cache entry is the same bits written alone as in a batch of 17."""
    gen = torch.Generator().manual_seed(3)
    kv, w, cos, sin = _inputs(17, torch.bfloat16, gen, device)
    loc = torch.arange(17, device=device) * 2

    def cache():
        if fp8:
            return torch.zeros(34, 656, dtype=torch.uint8, device=device)
        return torch.zeros(34, 576, dtype=torch.bfloat16, device=device)

    batch = cache()
    store_mla_normed(batch, loc, kv, w, EPS, cos, sin, True)
    for r in (0, 8, 16):
        one = slice(r, r + 1)
        alone = cache()
        store_mla_normed(alone, loc[one], kv[one], w, EPS, cos[one], sin[one], True)
        assert torch.equal(alone[2 * r], batch[2 * r])


def test_latent_bad_inputs(device):
    kv, w = torch.zeros(2, 576, device=device), torch.ones(512, device=device)
    cos = sin = torch.zeros(2, 32, device=device)
    loc = torch.tensor([0, 9], device=device)
    dense = torch.zeros(8, 576, device=device)
    with pytest.raises(ValueError, match=r"loc: slots must lie in \[0, 8\)"):
        store_mla_normed(dense, loc, kv, w, EPS, cos, sin, True)
    with pytest.raises(ValueError, match=r"loc: slots must lie in \[0, 8\)"):
        store_mla_normed(torch.zeros(8, 656, dtype=torch.uint8, device=device), loc, kv, w, EPS, cos, sin, True)
    loc = torch.tensor([0, 1], device=device)
    with pytest.raises(ValueError, match="kv: expected shape"):
        store_mla_normed(dense, loc, torch.zeros(2, 512, device=device), w, EPS, cos, sin, True)
    with pytest.raises(ValueError, match="weight: expected shape"):
        store_mla_normed(dense, loc, kv, torch.ones(576, device=device), EPS, cos, sin, True)
    with pytest.raises(ValueError, match="cos: expected shape"):
        store_mla_normed(dense, loc, kv, w, EPS, torch.zeros(3, 32, device=device), sin, True)
    with pytest.raises(ValueError, match="loc: expected shape"):
        store_mla_normed(dense, loc[:1], kv, w, EPS, cos, sin, True)
    with pytest.raises(ValueError, match="cache: expected shape"):
        store_mla_normed(torch.zeros(8, 512, device=device), loc, kv, w, EPS, cos, sin, True)
    with pytest.raises(ValueError, match="mla cache: expected uint8"):
        store_mla_normed(torch.zeros(8, 600, dtype=torch.uint8, device=device), loc, kv, w, EPS, cos, sin, True)


def _query_inputs(rows, heads, nope, dtype, gen, device):
    """``q`` as a column view of a fused GEMM's output (its row stride past its width), ``w_uk`` a
    view of ``kv_b_proj``'s weight (the value rows after each head's ``nope`` rows)."""
    width = heads * (nope + 64)
    q = (torch.randn(rows, width + 32, generator=gen) * 3).to(dtype)[:, :width].view(rows, heads, nope + 64)
    w_uk = (torch.randn(heads, nope + 48, 512, generator=gen) / 8).to(dtype)[:, :nope]
    angles = torch.rand(rows, 32, generator=gen) * 100
    return q.to(device), w_uk.to(device), angles.cos().to(device), angles.sin().to(device)


def _check_query(got, q, w_uk, cos, sin, interleaved):
    """The RoPE'd columns exactly the reference's; the absorbed ones within two roundings to the
    dtype (``2**-7`` relative for bf16) of the exact sum plus the fp32 sum's ``2 D 2**-24 sum |q w|``."""
    q, w_uk, got = q.cpu(), w_uk.cpu(), got.cpu()
    want = reference_mla_query(q, w_uk, cos.cpu(), sin.cpu(), interleaved)
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    assert torch.equal(got[..., 512:], want[..., 512:])
    nope = q.shape[-1] - 64
    magnitude = torch.einsum("rhd,hdn->rhn", q[..., :nope].double().abs(), w_uk.double().abs())
    ulp = 2.0 ** -7 if q.dtype == torch.bfloat16 else 2.0 ** -23
    bound = 1.01 * ulp * want[..., :512].double().abs() + 2 * nope * 2.0 ** -24 * magnitude
    assert torch.all((got[..., :512].double() - want[..., :512].double()).abs() <= bound)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rows,heads,nope", [(1, 4, 192), (3, 16, 128), (17, 2, 64), (65, 1, 40), (0, 2, 64)])
def test_mla_query_within_rounding(dtype, interleaved, rows, heads, nope, device):
    gen = torch.Generator().manual_seed(rows * 31 + heads)
    q, w_uk, cos, sin = _query_inputs(rows, heads, nope, dtype, gen, device)
    _check_query(mla_query(q, w_uk, cos, sin, interleaved), q, w_uk, cos, sin, interleaved)


@pytest.mark.parametrize("rows,row_invariant", [(9, False), (100, False), (520, True)])
def test_mla_query_rows_independent_of_batch(rows, row_invariant, device):
    """A row's bits are those of the row alone below a prefill chunk's rows, and at any count when
    row-invariant."""
    gen = torch.Generator().manual_seed(rows)
    q, w_uk, cos, sin = _query_inputs(rows, 2, 128, torch.bfloat16, gen, device)
    batch = mla_query(q, w_uk, cos, sin, True, row_invariant)
    for r in (0, rows - 1):
        one = slice(r, r + 1)
        assert torch.equal(mla_query(q[one], w_uk, cos[one], sin[one], True, row_invariant), batch[one])


def test_mla_query_large_tiles_within_rounding(device):
    """A prefill chunk's rows in the default mode's 64-row tiles: still within the bound, every row written."""
    gen = torch.Generator().manual_seed(7)
    q, w_uk, cos, sin = _query_inputs(PREFILL_MIN_ROWS + 9, 2, 192, torch.bfloat16, gen, device)
    assert mla_query_tiles(PREFILL_MIN_ROWS + 9, torch.bfloat16, False)[0] == 64
    _check_query(mla_query(q, w_uk, cos, sin, False), q, w_uk, cos, sin, False)


def test_mla_query_rope_alone_leaves_the_product_columns(device):
    """``launch_mla_query(..., product=False)`` (the RoPE after a cuBLAS product in
    ``scripts/bench_mla_query.py``) writes the reference's RoPE columns and nothing else."""
    gen = torch.Generator().manual_seed(8)
    q, w_uk, cos, sin = _query_inputs(70, 3, 64, torch.bfloat16, gen, device)
    out = torch.full((70, 3, 576), float("nan"), dtype=q.dtype, device=device)
    launch_mla_query(q, w_uk, cos, sin, True, out, mla_query_tiles(70, q.dtype, False), False)
    want = reference_mla_query(q.cpu(), w_uk.cpu(), cos.cpu(), sin.cpu(), True)
    assert torch.equal(out[..., 512:].cpu(), want[..., 512:])
    assert torch.isnan(out[..., :512]).all()


def test_mla_query_bad_inputs(device):
    gen = torch.Generator().manual_seed(6)
    q, w_uk, cos, sin = _query_inputs(2, 4, 64, torch.bfloat16, gen, device)
    with pytest.raises(ValueError, match="q: expected dtype"):
        mla_query(q.half(), w_uk, cos, sin, True)
    with pytest.raises(ValueError, match="q: expected a last dim"):
        mla_query(q[..., :64], w_uk, cos, sin, True)
    with pytest.raises(ValueError, match="w_uk: expected dtype"):
        mla_query(q, w_uk.float(), cos, sin, True)
    with pytest.raises(ValueError, match="w_uk: expected shape"):
        mla_query(q, w_uk[:3], cos, sin, True)
    with pytest.raises(ValueError, match="w_uk: expected shape"):
        mla_query(q[..., 1:], w_uk, cos, sin, True)
    with pytest.raises(ValueError, match="cos: expected shape"):
        mla_query(q, w_uk, cos[:1], sin, True)
    with pytest.raises(ValueError, match="sin: expected dtype"):
        mla_query(q, w_uk, cos, sin.double(), True)


def _weights_bound(x, weight, scale):
    """Twice K fp32 roundings of the largest partial sum, at most: ``2 K 2**-24 sum |x w| scale``
    would be the worst case; blocked sums stay far below it, so the test asks for 16 ulps of
    ``sum |x w|``, which a weight read as bf16 (2**-9 a product) exceeds."""
    return 16 * 2.0 ** -24 * (x.abs().double() @ weight.abs().float().double().T).float() * scale


EDGE_ROWS = [0, 1, 7, 8, 9, 63, 64, 65, 256]
# (heads, hidden): no split (1 block; 2 blocks, odd K), odd heads and K over 3 uneven chunks (2050:
# 9 blocks, the last 2 values wide), 2 chunks (1000), the presets' GLM-5 and DeepSeek-V3.2 shapes
SMALL_SHAPES = [(4, 256), (20, 300), (5, 2050), (3, 1000)]
PRESET_SHAPES = [(32, 6144), (64, 7168)]


@pytest.mark.parametrize("heads,hidden,splits", [(4, 256, (1, 1)), (20, 300, (2, 1)), (5, 2050, (3, 3)),
                                                 (3, 1000, (2, 2)), (32, 6144, (3, 8)), (64, 7168, (7, 4)),
                                                 (32, 2048, (2, 4)), (200, 6144, (24, 1))])
def test_index_weights_splits(heads, hidden, splits):
    """K chunks from the heads, K and the SMs only (132 off-GPU): about two programs per SM at one
    row tile (GLM-5: 32 heads x 8 chunks), every chunk >= 2 blocks of 256, none empty."""
    assert index_weights_splits(heads, hidden, "cpu") == splits


def _check_index_weights(dtype, rows, heads, hidden, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
    weight = torch.randn(heads, hidden, generator=gen).to(device)
    scale = 128 ** -0.5 * heads ** -0.5
    got = index_weights(x, weight, scale)
    assert got.dtype == torch.float32 and got.shape == (rows, heads)
    want = reference_index_weights(x.cpu(), weight.cpu(), scale)
    assert torch.all((got.cpu() - want).abs() <= _weights_bound(x.cpu(), weight.cpu(), scale))
    return x, weight, got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", EDGE_ROWS)
@pytest.mark.parametrize("heads,hidden", SMALL_SHAPES)
def test_index_weights(dtype, rows, heads, hidden, device):
    _check_index_weights(dtype, rows, heads, hidden, device, rows * 7 + heads)


@pytest.mark.parametrize("rows", [1, 9, 65])
@pytest.mark.parametrize("heads,hidden", PRESET_SHAPES)
def test_index_weights_preset_shapes(rows, heads, hidden, device):
    _check_index_weights(torch.bfloat16, rows, heads, hidden, device, rows + heads)


@pytest.mark.parametrize("heads,hidden", [(64, 6144), (5, 2050)])
def test_index_weights_rows_independent_of_batch(heads, hidden, device):
    """A row's bits alone, in a batch of 9 and of 18 (other row tiles, other rows' values) are the
    same, and a second launch (a graph replay: the tile counters are left at 0) repeats them."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(18, hidden, generator=gen).to(torch.bfloat16).to(device)
    weight = torch.randn(heads, hidden, generator=gen).to(device)
    batch = index_weights(x, weight, 0.01)
    assert torch.equal(index_weights(x, weight, 0.01), batch)
    assert not device_facts._counters[x.device].any()
    part = index_weights(x[:9], weight, 0.01)
    for r in (0, 7, 8):
        assert torch.equal(index_weights(x[r:r + 1], weight, 0.01), batch[r:r + 1])
        assert torch.equal(part[r:r + 1], batch[r:r + 1])
    assert torch.equal(index_weights(x[17:], weight, 0.01), batch[17:])


def test_index_weights_compiles_for_sm90_without_spills():
    """Without a GPU: the split kernel at the presets' shapes, 1 and 64 rows, compiles for sm_90
    without spills or local memory (48 / 52 registers; 8 / 4 K chunks on 132 SMs);
    scripts/compile_decode_epilogues.py's compile, in a subprocess."""
    out = run_in_scripts("compile_decode_epilogues",
                         "for heads, hidden in c.WEIGHT_SHAPES:\n"
                         "    for rows in c.ROW_COUNTS:\n"
                         "        r = c.compile_index_weights(heads, hidden, rows)\n"
                         "        local = sum(n for op, n in r['sass'].items() if op.startswith(('LDL', 'STL')))\n"
                         "        print('case', heads, hidden, rows, r['splits'], r['regs'], r['spill'], local)")
    cases = [tuple(map(int, line.split()[1:])) for line in out.splitlines() if line.startswith("case ")]
    assert [case[:4] for case in cases] == [(32, 6144, 1, 8), (32, 6144, 64, 8), (64, 7168, 1, 4),
                                            (64, 7168, 64, 4)], out
    for *_, regs, spilled, local in cases:
        assert 0 < regs <= 128 and spilled == 0 and local == 0, out


def test_index_weights_bad_inputs(device):
    with pytest.raises(ValueError, match="weight: expected shape"):
        index_weights(torch.zeros(2, 256, device=device), torch.zeros(4, 128, device=device), 1.0)
    with pytest.raises(ValueError, match="x: expected dtype"):
        index_weights(torch.zeros(2, 256, dtype=torch.float16, device=device), torch.zeros(4, 256, device=device),
                      1.0)
    with pytest.raises(ValueError, match="x: expected 2 dimensions"):
        index_weights(torch.zeros(2, 1, 256, device=device), torch.zeros(4, 256, device=device), 1.0)


class _Stop(Exception):
    pass


def _tiny_attention(gen):
    from dsaspec.configs.model_config import get_config
    from dsaspec.distributed.tp_group import TPGroup
    from dsaspec.layers.attention.mla import MLAAttention

    config = get_config("tiny")
    attn = MLAAttention(config, 0, TPGroup.single(), dtype=torch.bfloat16)
    for param in attn.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.1 + (1.0 if param.dim() == 1 else 0.0))
    return attn


def _step(ops, angles, loc):
    return SimpleNamespace(cos=angles.cos(), sin=angles.sin(), out_cache_loc=loc, ops=ops, check_values=True,
                           seeded=True, selected=None, attn=SimpleNamespace(workspace=None))


@pytest.mark.parametrize("fp8", [False, True])
def test_attention_triton_path_writes_the_torch_paths_entries(fp8):
    """MLAAttention (tiny, bf16) with the Triton ops against its torch ops: the cache entries
    its forward writes before the attention (stopped there), to one ulp / one e4m3 step, and
    the attention's query: its RoPE'd part exactly, its absorbed part (another sum order) to two ulps."""
    from dsaspec.layers.attention.dsa_ops import dsa_ops

    gen = torch.Generator().manual_seed(2)
    attn = _tiny_attention(gen)
    rows = 3
    x = torch.randn(rows, attn.config.hidden_size, generator=gen).to(torch.bfloat16)
    angles = torch.rand(rows, 32, generator=gen) * 100
    loc = torch.tensor([11, 2, 7])
    entries, queries = [], []

    def stop(q, *args, **kwargs):
        queries.append(q)
        raise _Stop

    for use_triton in (False, True):
        ops = SimpleNamespace(**vars(dsa_ops(use_triton, False, False)))
        ops.sparse_mla_decode = stop
        cache = torch.zeros(16, 656, dtype=torch.uint8) if fp8 else torch.zeros(16, 576, dtype=torch.bfloat16)
        with pytest.raises(_Stop):
            attn(x, _step(ops, angles, loc), cache, None)
        entries.append(read_mla(cache, loc) if fp8 else cache[loc].float())
    assert queries[0].shape == (rows, attn.num_heads, 576)
    assert torch.equal(queries[1][..., 512:], queries[0][..., 512:])
    absorbed, torch_absorbed = queries[1][..., :512].float(), queries[0][..., :512].float()
    torch.testing.assert_close(absorbed, torch_absorbed, rtol=2.0 ** -6,
                               atol=2.0 ** -8 * float(torch_absorbed.abs().max()))
    want, got = entries
    assert torch.equal(got[:, 512:], want[:, 512:])
    if fp8:
        step = want[:, :512].abs().reshape(rows, 4, 128).amax(-1).repeat_interleave(128, dim=1) / 8
        assert torch.all((got[:, :512] - want[:, :512]).abs() <= step)
    else:
        torch.testing.assert_close(got[:, :512], want[:, :512], rtol=2.0 ** -7, atol=1e-6)


class _CountOps(TorchDispatchMode):
    """Counts the aten ops that are not views (or allocations) while ``counting``."""

    def __init__(self):
        super().__init__()
        self.ops, self.counting = collections.Counter(), True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if self.counting and not func.is_view and name not in ("empty", "empty_strided"):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def test_attention_triton_path_aten_ops(monkeypatch):
    """One decode row of MLAAttention (tiny, bf16, fused input projection) with the Triton ops:
    besides the ops (one call each), ``q_a_layernorm`` (one kernel on the GPU) and W_UV's product
    (the row-invariant GEMM at decode rows) only its three projection GEMMs run as aten ops: no
    elementwise RoPE, dtype copy, concatenation or cuBLAS bmm."""
    from dsaspec.layers.attention.dsa_ops import dsa_ops

    gen = torch.Generator().manual_seed(3)
    attn = _tiny_attention(gen)
    attn.fuse_projections()
    x = torch.randn(1, attn.config.hidden_size, generator=gen).to(torch.bfloat16)
    angles, loc = torch.rand(1, 32, generator=gen) * 100, torch.tensor([5])
    mode = _CountOps()

    def uncounted(name, fn):
        def call(*args, **kwargs):
            mode.counting = False
            try:
                return fn(*args, **kwargs)
            finally:
                mode.counting = True
                mode.ops["op " + name] += 1
        return call

    ops = SimpleNamespace(**{name: uncounted(name, fn) for name, fn in vars(dsa_ops(True, False, False)).items()})
    ops.sparse_mla_decode = uncounted("sparse_mla_decode", lambda *args, **kwargs: None)
    attn.q_a_layernorm.forward = uncounted("q_a_layernorm", attn.q_a_layernorm.forward)
    from dsaspec.ops import row_invariant
    monkeypatch.setattr(row_invariant, "bmm", uncounted("row-invariant bmm", row_invariant.bmm))
    step, cache = _step(ops, angles, loc), torch.zeros(8, 576, dtype=torch.bfloat16)
    with torch.no_grad(), mode:
        attn(x, step, cache, None)
    assert dict(mode.ops) == {"mm": 3, "op row-invariant bmm": 1, "op q_a_layernorm": 1, "op store_mla_normed": 1,
                              "op mla_query": 1, "op sparse_mla_decode": 1}


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rows", [1, 17, 64])
def test_gpu_kernels_match_references(fp8, rows):
    """On the GPU: the latent epilogue (rope exact, latent one ulp / one e4m3 step, poison
    untouched) and the 64-head, 6144-wide head weights within the rounding bound."""
    gen = torch.Generator().manual_seed(rows)
    kv, w, cos, sin = _inputs(rows, torch.bfloat16, gen, "cuda")
    loc = torch.randperm(2 * rows, generator=gen)[:rows].cuda()
    width = 656 if fp8 else 576
    dtype = torch.uint8 if fp8 else torch.bfloat16
    cache = torch.full((2 * rows, width), POISON if fp8 else 7.0, dtype=dtype, device="cuda")
    store_mla_normed(cache, loc, kv, w, EPS, cos, sin, True)
    want_rows = reference_mla_latent(kv.cpu(), w.cpu(), EPS, cos.cpu(), sin.cpu(), True)
    cache, loc = cache.cpu(), loc.cpu()
    untouched = torch.ones(2 * rows, dtype=torch.bool)
    untouched[loc] = False
    if fp8:
        expected = write_mla(torch.full((2 * rows, 656), POISON, dtype=torch.uint8), loc, want_rows)
        assert torch.equal(cache[:, 528:], expected[:, 528:])
        got, want = read_mla(cache, loc), read_mla(expected, loc)
        step = want[:, :512].abs().reshape(rows, 4, 128).amax(-1).repeat_interleave(128, dim=1) / 8
        assert torch.all((got[:, :512] - want[:, :512]).abs() <= step)
        assert torch.all(cache[untouched] == POISON)
    else:
        assert torch.equal(cache[loc][:, 512:], want_rows[:, 512:])
        torch.testing.assert_close(cache[loc][:, :512].float(), want_rows[:, :512].float(), rtol=2.0 ** -7,
                                   atol=1e-6)
        assert torch.all(cache[untouched] == 7.0)
    x = torch.randn(rows, 6144, generator=gen).to(torch.bfloat16)
    weight = torch.randn(64, 6144, generator=gen)
    scale = 128 ** -0.5 * 64 ** -0.5
    got_w = index_weights(x.cuda(), weight.cuda(), scale).cpu()
    assert torch.all((got_w - reference_index_weights(x, weight, scale)).abs() <= _weights_bound(x, weight, scale))
    assert torch.equal(index_weights(x[:1].cuda(), weight.cuda(), scale).cpu(), got_w[:1])


@pytest.mark.gpu
@pytest.mark.parametrize("heads,hidden", PRESET_SHAPES + SMALL_SHAPES)
def test_gpu_index_weights(heads, hidden):
    """On the GPU: the head weights within the rounding bound at every edge row count, each row's
    bits those of the row alone, and a CUDA graph of the split launch replays the eager bits (the
    tile counters are left at 0 by every launch)."""
    device = torch.device("cuda")
    for rows in EDGE_ROWS:
        x, weight, got = _check_index_weights(torch.bfloat16, rows, heads, hidden, device, rows + hidden)
        for r in sorted({0, rows // 2, rows - 1}) if rows else ():
            assert torch.equal(index_weights(x[r:r + 1], weight, 0.5), index_weights(x, weight, 0.5)[r:r + 1])
    x, weight, eager = _check_index_weights(torch.bfloat16, 9, heads, hidden, device, 0)
    scale = 128 ** -0.5 * heads ** -0.5
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        index_weights(x, weight, scale)   # compiles (and allocates the counters) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = index_weights(x, weight, scale)
    for _ in range(3):
        captured.zero_()
        graph.replay()
        assert torch.equal(captured, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,heads,nope", [(1, 8, 192), (4, 16, 128), (32, 64, 192), (192, 8, 192), (600, 8, 192)])
def test_gpu_mla_query_within_rounding(rows, heads, nope):
    """On the GPU (the rank presets' heads and widths, decode to prefill rows): the absorbed query
    within the rounding bound, its RoPE exact, in both modes and both RoPE layouts; each row's bits
    its own alone in the row-invariant mode."""
    gen = torch.Generator().manual_seed(rows + heads)
    q, w_uk, cos, sin = _query_inputs(rows, heads, nope, torch.bfloat16, gen, "cuda")
    for interleaved in (True, False):
        for row_invariant in (False, True):
            got = mla_query(q, w_uk, cos, sin, interleaved, row_invariant)
            _check_query(got, q, w_uk, cos, sin, interleaved)
    one = slice(rows - 1, rows)
    assert torch.equal(mla_query(q[one], w_uk, cos[one], sin[one], False, True), got[one])
