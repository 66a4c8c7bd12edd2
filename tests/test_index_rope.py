"""The indexer's fused query/key epilogues (dsaspec.ops.index_rope) against the plain-torch
reference: the query's RoPE and Hadamard rotation exactly (the reference's transform is the
kernel's: the same fp32 butterflies in the same order), the reference's rotation against
``y @ H`` in float64; the key's LayerNorm (sums in another order) within a stated tolerance;
every row's bits independent of the batch; both epilogues in one launch bit for bit the two
launches; the Indexer's Triton path against its torch path; the sm_90 compile without spills."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from compile_scripts import run_in_scripts
from dsaspec.ops.index_rope import index_q_rope, indexer_epilogues, store_index_k_normed
from dsaspec.ops.index_weights import index_weights
from dsaspec.reference.fp8_kv import read_index_k, write_index_k
from dsaspec.reference.index_rope import reference_index_k, reference_index_q_rope

from dsa_inputs import random_tiny_indexer

pytestmark = pytest.mark.interpreter

ROW_COUNTS = [1, 3, 17, 64]
EDGE_ROWS = [0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 256]
PAGE_BYTES = 64 * 132
EPS = 1e-5


def _angles(rows, rope_dim, gen, device):
    angles = torch.rand(rows, rope_dim // 2, generator=gen) * 100
    return angles.cos().to(device), angles.sin().to(device)


def _keys(rows, dtype, gen, device):
    k = (torch.randn(rows, 128, generator=gen) * 3 + 1).to(dtype).to(device)
    w = torch.randn(128, generator=gen).to(dtype).to(device)
    b = torch.randn(128, generator=gen).to(dtype).to(device)
    return k, w, b


def _ulps(dtype):
    """One unit in the last place, relative: the LayerNorm's / rotation's sums may round the
    other way before the model-dtype rounding."""
    return 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("heads,rope_dim", [(4, 64), (3, 32)])
def test_q_rope_exact(dtype, interleaved, rows, heads, rope_dim, device):
    gen = torch.Generator().manual_seed(rows * 10 + heads)
    q = torch.randn(rows, heads, 128, generator=gen).to(dtype).to(device)
    cos, sin = _angles(rows, rope_dim, gen, device)
    got = index_q_rope(q, cos, sin, rope_dim, interleaved, rotate=False)
    want = reference_index_q_rope(q.cpu(), cos.cpu(), sin.cpu(), rope_dim, interleaved, rotate=False)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_q_rope_rotated_exact(dtype, rows, device):
    gen = torch.Generator().manual_seed(rows)
    q = torch.randn(rows, 5, 128, generator=gen).to(dtype).to(device)
    cos, sin = _angles(rows, 64, gen, device)
    got = index_q_rope(q, cos, sin, 64, True, rotate=True)
    want = reference_index_q_rope(q.cpu(), cos.cpu(), sin.cpu(), 64, True, rotate=True)
    assert torch.equal(got.cpu(), want)


def test_reference_rotation_is_the_hadamard_matmul():
    """The reference's butterflies equal ``y @ H * 128 ** -0.5`` (float64, H[i, j] =
    (-1) ** popcount(i & j)) to fp32 rounding: 7 rounded stages and the scale."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(64, 2, 128, generator=gen)
    cos, sin = torch.ones(64, 32), torch.zeros(64, 32)
    got = reference_index_q_rope(q, cos, sin, 64, True, rotate=True).double()
    h = torch.tensor([[(-1.0) ** bin(i & j).count("1") for j in range(128)] for i in range(128)],
                     dtype=torch.float64)
    want = q.double() @ h * 128 ** -0.5
    limit = 8 * 2.0 ** -24 * (q.double().abs() @ h.abs() * 128 ** -0.5)
    assert torch.all((got - want).abs() <= limit)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_k_dense_cache(dtype, interleaved, rows, device):
    """Written rows hold the reference key (one ulp), the other slots stay untouched."""
    gen = torch.Generator().manual_seed(rows + 100)
    k, w, b = _keys(rows, dtype, gen, device)
    cos, sin = _angles(rows, 64, gen, device)
    loc = torch.randperm(2 * rows + 5, generator=gen)[:rows].to(device)
    cache = torch.full((2 * rows + 5, 128), 7.0, dtype=dtype, device=device)
    store_index_k_normed(cache, loc, k, w, b, EPS, cos, sin, 64, interleaved)
    want = reference_index_k(k.cpu(), w.cpu(), b.cpu(), EPS, cos.cpu(), sin.cpu(), 64, interleaved, rotate=False)
    cache = cache.cpu()
    torch.testing.assert_close(cache[loc.cpu()].float(), want.float(), rtol=_ulps(dtype), atol=1e-5)
    untouched = torch.ones(cache.shape[0], dtype=torch.bool)
    untouched[loc.cpu()] = False
    assert torch.all(cache[untouched] == 7.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_k_fp8_cache(dtype, rows, device):
    """The rotated key quantized at its slot: the reference quantization of the reference key,
    to one e4m3 step (a key one ulp apart may round to the neighbouring code); other bytes
    untouched."""
    gen = torch.Generator().manual_seed(rows + 200)
    k, w, b = _keys(rows, dtype, gen, device)
    cos, sin = _angles(rows, 64, gen, device)
    pages = 3
    loc = torch.randperm(pages * 64, generator=gen)[:rows].to(device)
    cache = torch.zeros(pages, PAGE_BYTES, dtype=torch.uint8, device=device)
    store_index_k_normed(cache, loc, k, w, b, EPS, cos, sin, 64, False)
    key = reference_index_k(k.cpu(), w.cpu(), b.cpu(), EPS, cos.cpu(), sin.cpu(), 64, False, rotate=True)
    expected = write_index_k(torch.zeros(pages, PAGE_BYTES, dtype=torch.uint8), loc.cpu(), key)
    got, want = read_index_k(cache.cpu(), loc.cpu()), read_index_k(expected, loc.cpu())
    step = want.abs().amax(dim=1, keepdim=True) / 8
    assert torch.all((got - want).abs() <= step)
    mismatched = (cache.cpu() != expected).float().mean().item()
    assert mismatched < 0.01


@pytest.mark.parametrize("fp8", [False, True])
def test_rows_independent_of_batch(fp8, device):
    """A row's query and cache entry are the same bits alone as in a batch of 17."""
    gen = torch.Generator().manual_seed(5)
    rows = 17
    q = torch.randn(rows, 4, 128, generator=gen).to(torch.bfloat16).to(device)
    k, w, b = _keys(rows, torch.bfloat16, gen, device)
    cos, sin = _angles(rows, 64, gen, device)
    loc = torch.arange(rows, device=device) * 3

    def cache():
        if fp8:
            return torch.zeros(1, PAGE_BYTES, dtype=torch.uint8, device=device)
        return torch.zeros(64, 128, dtype=torch.bfloat16, device=device)

    batch_q = index_q_rope(q, cos, sin, 64, True, rotate=fp8)
    batch = cache()
    store_index_k_normed(batch, loc, k, w, b, EPS, cos, sin, 64, True)
    for r in (0, 7, 16):
        one = slice(r, r + 1)
        assert torch.equal(index_q_rope(q[one], cos[one], sin[one], 64, True, rotate=fp8), batch_q[one])
        alone = cache()
        store_index_k_normed(alone, loc[one], k[one], w, b, EPS, cos[one], sin[one], 64, True)
        if fp8:
            entry = slice(128 * 3 * r, 128 * 3 * r + 128)
            scale = slice(8192 + 4 * 3 * r, 8192 + 4 * 3 * r + 4)
            assert torch.equal(alone[0, entry], batch[0, entry])
            assert torch.equal(alone[0, scale], batch[0, scale])
        else:
            assert torch.equal(alone[3 * r], batch[3 * r])


def _cache(fp8, slots, dtype, device):
    if fp8:
        return torch.full(((slots + 63) // 64, PAGE_BYTES), 0xA5, dtype=torch.uint8, device=device)
    return torch.full((slots, 128), 7.0, dtype=dtype, device=device)


def _head_inputs(rows, hidden, dtype, gen, device):
    """The layer input ``[rows, hidden]`` and an fp32 ``weights_proj`` of 32 heads."""
    return (torch.randn(rows, hidden, generator=gen).to(dtype).to(device),
            torch.randn(32, hidden, generator=gen).to(device) / hidden ** 0.5)


def _one_launch_is_the_two(rows, heads, rope_dim, dtype, interleaved, fp8, device, seed, hidden=512):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, 128, generator=gen).to(dtype).to(device)
    k, w, b = _keys(rows, dtype, gen, device)
    cos, sin = _angles(rows, rope_dim, gen, device)
    slots = 2 * rows + 70
    loc = torch.randperm(slots, generator=gen)[:rows].to(device)
    two, one = _cache(fp8, slots, dtype, device), _cache(fp8, slots, dtype, device)
    x, head_weight = _head_inputs(rows, hidden, dtype, gen, device)
    q_two = index_q_rope(q, cos, sin, rope_dim, interleaved, rotate=fp8)
    store_index_k_normed(two, loc, k, w, b, EPS, cos, sin, rope_dim, interleaved)
    weights_two = index_weights(x, head_weight, 0.03)
    q_one, weights_one = indexer_epilogues(q, one, loc, k, w, b, EPS, cos, sin, rope_dim, interleaved, x,
                                           head_weight, 0.03)
    assert q_one.shape == q.shape and q_one.dtype == q.dtype
    assert torch.equal(q_one, q_two)
    assert torch.equal(one, two)
    assert torch.equal(weights_one, weights_two)


@pytest.mark.parametrize("fp8", [False, True])
def test_epilogues_without_the_layer_input_leave_out_the_head_weights(fp8, device):
    """``x`` None: no head weights (None back), the query and the whole cache as with them."""
    rows, rope_dim = 33, 64
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(rows, 3, 128, generator=gen).to(torch.bfloat16).to(device)
    k, w, b = _keys(rows, torch.bfloat16, gen, device)
    cos, sin = _angles(rows, rope_dim, gen, device)
    loc = torch.randperm(2 * rows + 70, generator=gen)[:rows].to(device)
    x, head_weight = _head_inputs(rows, 512, torch.bfloat16, gen, device)
    caches = [_cache(fp8, 2 * rows + 70, torch.bfloat16, device) for _ in range(2)]
    q_with, weights = indexer_epilogues(q, caches[0], loc, k, w, b, EPS, cos, sin, rope_dim, True, x,
                                        head_weight, 0.03)
    q_without, none = indexer_epilogues(q, caches[1], loc, k, w, b, EPS, cos, sin, rope_dim, True, None,
                                        head_weight, 0.03)
    assert weights.shape == (rows, 32) and none is None
    assert torch.equal(q_with, q_without) and torch.equal(caches[0], caches[1])


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rows", EDGE_ROWS)
def test_one_launch_is_the_two_launches(rows, fp8, device):
    """``indexer_epilogues``: the query, the whole cache (written slots and the untouched rest) and
    the head weights bit for bit what ``index_q_rope``, ``store_index_k_normed`` and
    ``index_weights`` give, bf16, at the edge row counts (one grid: query blocks, key blocks, then
    the head weights' programs: 2 K chunks at 512 columns)."""
    _one_launch_is_the_two(rows, 3, 64, torch.bfloat16, True, fp8, device, rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("heads,rope_dim,rows", [(32, 64, 1), (32, 64, 5), (5, 32, 17)])
def test_one_launch_is_the_two_launches_shapes(dtype, interleaved, heads, rope_dim, rows, device):
    """The same for GLM-5's 32 index heads and an odd head count with a 32-wide rope, both
    layouts, bf16 and fp32 (the FP8 cache takes bf16 keys only in the runtime; fp32 here too), the
    head weights over one K chunk (256 columns) and over 8 (GLM-5's 6144 at one row)."""
    for fp8 in (False, True):
        _one_launch_is_the_two(rows, heads, rope_dim, dtype, interleaved, fp8, device, rows + heads,
                               hidden=6144 if rows == 1 else 256)


class _CountOps(TorchDispatchMode):
    """Counts every aten op run while installed, by name."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rows,heads,head_stride", [(1, 32, 128), (5, 3, 128), (17, 4, 128), (5, 3, 256)])
def test_query_read_in_place_from_a_column_view(rows, heads, head_stride, fp8, device):
    """The query as the layer's fused ``q_b_proj`` + ``wq_b`` GEMM hands it over: a column view of
    a wider output (row stride past the heads, the indexer's columns last; and a head stride past
    128). ``indexer_epilogues`` and ``index_q_rope`` read it in place: the same bits as from
    its contiguous copy, and the same aten ops (no copy of the query)."""
    gen = torch.Generator().manual_seed(rows * 7 + heads)
    wide = torch.randn(rows, 320 + heads * head_stride, generator=gen).to(torch.bfloat16).to(device)
    view = wide[:, 320:].view(rows, heads, head_stride)[..., head_stride - 128:]
    k, w, b = _keys(rows, torch.bfloat16, gen, device)
    cos, sin = _angles(rows, 64, gen, device)
    loc = torch.randperm(2 * rows + 8, generator=gen)[:rows].to(device)
    x, head_weight = _head_inputs(rows, 256, torch.bfloat16, gen, device)
    results = []
    for q in (view.contiguous(), view):
        cache = _cache(fp8, 2 * rows + 8, torch.bfloat16, device)
        counted = _CountOps()
        with counted:
            out, _ = indexer_epilogues(q, cache, loc, k, w, b, EPS, cos, sin, 64, True, x, head_weight, 0.03)
            alone = index_q_rope(q, cos, sin, 64, True, rotate=fp8)
        results.append((out, alone, cache, counted.ops))
    (want, want_alone, want_cache, want_ops), (got, got_alone, got_cache, got_ops) = results
    assert got.is_contiguous() and torch.equal(got, want) and torch.equal(got_alone, want_alone)
    assert torch.equal(got_alone, got) and torch.equal(got_cache, want_cache)
    assert got_ops == want_ops


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_gpu_epilogues_hold_the_same_contracts(rows):
    """Natively on a GPU (FMA contraction off, as the kernel launches): the query RoPE'd and
    rotated exactly, keys within one ulp (dense cache) or one e4m3 step (FP8 cache) of the
    reference, rows independent of the batch, both epilogues in one launch bit for bit the two
    launches, the query read in place from a column view; bf16, GLM-5's 32 index heads (and fp32,
    5 heads, a 32-wide rope)."""
    device = torch.device("cuda")
    for interleaved in (True, False):
        test_q_rope_exact(torch.bfloat16, interleaved, rows, 32, 64, device)
        test_k_dense_cache(torch.bfloat16, interleaved, rows, device)
    test_q_rope_rotated_exact(torch.bfloat16, rows, device)
    if rows <= 3 * 64:
        test_k_fp8_cache(torch.bfloat16, rows, device)
    for fp8 in (False, True):
        test_rows_independent_of_batch(fp8, device)
        for head_stride in (128, 256):
            test_query_read_in_place_from_a_column_view(rows, 32, head_stride, fp8, device)
        for interleaved in (True, False):
            _one_launch_is_the_two(rows, 32, 64, torch.bfloat16, interleaved, fp8, device, rows)
    _one_launch_is_the_two(rows, 5, 32, torch.float32, False, False, device, rows)


def test_bad_inputs(device):
    q = torch.zeros(2, 4, 128, device=device)
    cos = sin = torch.zeros(2, 32, device=device)
    with pytest.raises(ValueError, match="q: expected rows of 128"):
        index_q_rope(torch.zeros(2, 4, 64, device=device), cos, sin, 64, True, rotate=False)
    with pytest.raises(ValueError, match="cos: expected shape"):
        index_q_rope(q, torch.zeros(3, 32, device=device), sin, 64, True, rotate=False)
    with pytest.raises(ValueError, match="rope_dim"):
        index_q_rope(q, cos, sin, 63, True, rotate=False)
    k, w = torch.zeros(2, 128, device=device), torch.ones(128, device=device)
    loc = torch.tensor([0, 9], device=device)
    with pytest.raises(ValueError, match=r"loc: slots must lie in \[0, 8\)"):
        store_index_k_normed(torch.zeros(8, 128, device=device), loc, k, w, w, EPS, cos, sin, 64, True)
    with pytest.raises(ValueError, match="cache: expected dtype"):
        store_index_k_normed(torch.zeros(16, 128, dtype=torch.bfloat16, device=device), loc, k, w, w, EPS,
                             cos, sin, 64, True)
    cache = torch.zeros(16, 128, device=device)
    x, head_weight = torch.zeros(2, 256, device=device), torch.zeros(32, 256, device=device)
    with pytest.raises(ValueError, match="k: expected q's dtype"):
        indexer_epilogues(q, cache, loc, k.bfloat16(), w, w, EPS, cos, sin, 64, True, x, head_weight, 1.0)
    with pytest.raises(ValueError, match=r"loc: slots must lie in \[0, 8\)"):
        indexer_epilogues(q, torch.zeros(8, 128, device=device), loc, k, w, w, EPS, cos, sin, 64, True, x,
                          head_weight, 1.0)
    with pytest.raises(ValueError, match="q: expected rows of 128"):
        indexer_epilogues(q[..., :64], cache, loc, k, w, w, EPS, cos, sin, 64, True, x, head_weight, 1.0)
    with pytest.raises(ValueError, match="head_weight: expected shape"):
        indexer_epilogues(q, cache, loc, k, w, w, EPS, cos, sin, 64, True, x, head_weight[:, :128], 1.0)


@pytest.mark.parametrize("fp8", [False, True])
def test_indexer_triton_path_matches_torch_path(fp8):
    """The Indexer with the Triton ops (fused epilogues) against its torch ops, bf16 model."""
    from types import SimpleNamespace

    from dsaspec.layers.attention.dsa_ops import dsa_ops

    rows = 3
    config, indexer, x, q_latent, gen = random_tiny_indexer(torch.bfloat16, seed=1, rows=rows)
    cos, sin = _angles(rows, config.qk_rope_head_dim, gen, "cpu")
    loc = torch.tensor([70, 3, 12])
    results = []
    for use_triton in (False, True):
        step = SimpleNamespace(cos=cos, sin=sin, out_cache_loc=loc, ops=dsa_ops(use_triton, False, False),
                               check_values=True)
        cache = (torch.zeros(2, PAGE_BYTES, dtype=torch.uint8) if fp8
                 else torch.zeros(128, 128, dtype=torch.bfloat16))
        q, weights = indexer(x, q_latent, step, cache)
        keys = read_index_k(cache, loc) if fp8 else cache[loc].float()
        results.append((q.float(), weights, keys))
    (q0, w0, k0), (q1, w1, k1) = results
    torch.testing.assert_close(w1, w0, rtol=1e-5, atol=1e-6)   # fused kernel: its own fp32 sum order
    torch.testing.assert_close(q1, q0, rtol=2.0 ** -7, atol=1e-5)
    if fp8:
        assert torch.all((k1 - k0).abs() <= k0.abs().amax(dim=1, keepdim=True) / 8)
    else:
        torch.testing.assert_close(k1, k0, rtol=2.0 ** -7, atol=1e-5)


def test_compiles_for_sm90_without_spills():
    """Without a GPU: every variant of the kernel (query with and without the rotation, key into
    a dense or an FP8 cache, a layer's query and key in one launch) compiles for sm_90 without
    spills or local memory, the rotated ones in at most 3x the instructions of the plain query
    (the rotation by a [128, 128] register tile spilled 5.5 - 6.4 KB, 6048 / 7840 instructions),
    a layer's query, key and head weights in one launch in no more instructions than the three
    launches (sm_90: 1952 / 3696 SASS instructions against 528 + 1072 + the head weights' alone /
    824 + 2552 + them) and at most 128 registers (72 / 80: 64 / 80 for the key alone);
    scripts/compile_fp8_dsa.py's compile, in a subprocess (it compiles instead of interpreting)."""
    out = run_in_scripts("compile_fp8_dsa",
                         "import compile_decode_epilogues as e\n"
                         "for kind in c.INDEX_ROPE_KINDS:\n"
                         "    r = c.compile_index_rope(kind)\n"
                         "    local = sum(n for op, n in r['sass'].items() if op.startswith(('LDL', 'STL')))\n"
                         "    print('kind', kind, r['regs'], r['spill'], local, r['instructions'])\n"
                         "r = e.compile_index_weights(32, 6144, c.ROWS)\n"
                         "print('kind', 'w', r['regs'], r['spill'], 0, r['instructions'])")
    lines = [line.split()[1:] for line in out.splitlines() if line.startswith("kind ")]
    results = {kind: tuple(map(int, rest)) for kind, *rest in lines}
    assert sorted(results) == ["k_dense", "k_fp8", "q", "q_rotated", "qk_dense", "qk_fp8", "w"], out
    for kind, (regs, spilled, local, _) in results.items():
        assert 0 < regs <= 255 and spilled == 0 and local == 0, out
    assert results["q_rotated"][3] <= 3 * results["q"][3], out
    assert results["k_fp8"][3] <= 3 * results["k_dense"][3], out
    for fused, q, k in (("qk_dense", "q", "k_dense"), ("qk_fp8", "q_rotated", "k_fp8")):
        assert results[fused][3] <= results[q][3] + results[k][3] + results["w"][3], out
        assert results[fused][0] <= 128, out
