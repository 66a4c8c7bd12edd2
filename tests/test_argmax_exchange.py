"""Argmax exchange kernels against the reference and against torch.argmax of the gathered fp32 logits.

TP 2, 3, 4 and 8 are emulated in one process: the shards are slices of one padded logits tensor,
every rank's partials are computed into a poisoned buffer, and the all-reduce is emulated by summing
the rank buffers in several orders (and with -0.0 written into the foreign slots, as a sign-rewriting
transport would). The tokens must equal ``torch.argmax(gathered[:, :vocab].float())``; that contract
is stated independently by ``first_max_index`` (numpy, no order key), which torch.argmax, the
reference and the kernels must all match.
"""

import math
import random

import numpy as np
import pytest
import torch

from dsaspec.ops.argmax_exchange import (
    DEFAULT_SPLIT_COLUMNS,
    TOPK_SPLIT_COLUMNS,
    argmax_partials,
    draft_finalize,
    exchange_layout,
    topk_finalize,
    topk_partials,
    topk_slot_lanes,
)
from dsaspec.reference.argmax_exchange import (
    KEY_NAN,
    KEY_NEG_INF,
    KEY_ZERO,
    argmax_finalize_reference,
    argmax_partials_reference,
    gathered_argmax_reference,
    order_key_nan_max_zeros_equal,
    stable_topk_reference,
    topk_finalize_reference,
    topk_partials_reference,
)

HAS_CUDA = torch.cuda.is_available()
FULL_VOCABS = (154880, 129280, 151936)

# fp32 / bf16 bit patterns of NaNs with either sign and various payloads (quiet and signalling).
NAN_BITS_FP32 = (0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFBFFFFF, 0x7FC01234)
NAN_BITS_BF16 = (0x7FC0, 0xFFC0, 0x7F81, 0xFFFF, 0x7FA5)
DENORMAL_BITS = {torch.float32: 0x00000001, torch.bfloat16: 0x0001}


def _from_bits(bits: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float32:
        return torch.tensor([bits - (1 << 32) if bits >= 1 << 31 else bits], dtype=torch.int32).view(torch.float32)
    return torch.tensor([bits - (1 << 16) if bits >= 1 << 15 else bits], dtype=torch.int16).view(torch.bfloat16)


def _put(logits, row, col, bits):
    logits[row, col] = _from_bits(bits, logits.dtype)[0]


def adversarial_logits(rows: int, vocab: int, shard: int, tp: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``[rows, tp * shard]`` logits: random rows plus one special pattern per row (cycling), padding poisoned."""
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    logits = torch.randn(rows, tp * shard, generator=gen).to(dtype)
    nan_bits = NAN_BITS_FP32 if dtype == torch.float32 else NAN_BITS_BF16
    boundaries = [r * shard for r in range(1, tp) if r * shard < vocab]
    for row in range(rows):
        case = row % 18
        top = logits[row, :vocab].float().max().item() + 1.0
        cols = [rnd.randrange(vocab) for _ in range(3)]
        if case == 1:  # tie inside one shard
            c = cols[0]
            logits[row, c] = top
            logits[row, min(vocab - 1, c + rnd.randrange(1, 4))] = top
        elif case == 2:  # tie across shards (and equal key in a later shard)
            for c in cols:
                logits[row, c] = top
        elif case == 3 and boundaries:  # tie straddling a shard boundary
            b = rnd.choice(boundaries)
            logits[row, b - 1] = top
            logits[row, b] = top
        elif case == 4:  # only ±0 at the top, the -0 / +0 spread over shards
            logits[row, :vocab] = -torch.rand(vocab, generator=gen).to(dtype) - 1
            logits[row, cols[0]] = -0.0
            logits[row, cols[1]] = 0.0
            logits[row, cols[2]] = -0.0
        elif case == 5:  # several NaNs, either sign, payloads
            for c, bits in zip(cols, rnd.sample(nan_bits, 3)):
                _put(logits, row, c, bits)
        elif case == 6:  # +inf ties against a NaN-free row
            logits[row, cols[0]] = float("inf")
            logits[row, cols[1]] = float("inf")
        elif case == 7:  # all -inf
            logits[row, :vocab] = float("-inf")
        elif case == 8:  # all NaN (mixed payloads)
            logits[row, :vocab] = float("nan")
            _put(logits, row, cols[0], nan_bits[1])
        elif case == 9:  # a denormal maximum over zeros and negatives
            logits[row, :vocab] = -torch.rand(vocab, generator=gen).to(dtype)
            logits[row, cols[0]] = 0.0
            _put(logits, row, cols[1], DENORMAL_BITS[dtype])
            _put(logits, row, cols[2], DENORMAL_BITS[dtype])
        elif case == 10:  # heavy ties: few distinct values
            logits[row] = torch.randint(-2, 3, (tp * shard,), generator=gen).to(dtype)
        elif case == 11:  # maximum on the last valid column / the first column
            logits[row, vocab - 1] = top
        elif case == 12:
            logits[row, 0] = top
            logits[row, vocab - 1] = top
        elif case == 13:  # -inf plus one finite value
            logits[row, :vocab] = float("-inf")
            logits[row, cols[0]] = -3.0e38 if dtype == torch.float32 else -3.0e38
        elif case == 14:  # a NaN and +inf in the same row: NaN wins
            logits[row, cols[0]] = float("inf")
            _put(logits, row, cols[1], nan_bits[2])
        elif case == 15:  # a large range: probabilities from ~1 down to subnormal and 0
            logits[row] = (torch.randn(tp * shard, generator=gen) * 40).to(dtype)
        elif case == 16:  # huge finite values: differences overflow to -inf
            logits[row, cols[0]] = 3.0e38
            logits[row, cols[1]] = -3.0e38
            logits[row, cols[2]] = 3.0e38
        elif case == 17:  # one value everywhere: every column ties
            logits[row] = 0.75
    # Padding columns must never win, whatever they hold.
    if vocab < tp * shard:
        pad = logits[:, vocab:]
        pad.copy_(torch.tensor([float("nan"), float("inf"), 1e30, 0.0], dtype=dtype).repeat(pad.shape[1] // 4 + 1)[:pad.shape[1]])
    return logits


def first_max_index(logits: torch.Tensor) -> torch.Tensor:
    """The oracle, written without torch.argmax or an order key: per row, the first NaN column if the
    row has a NaN, else the first column equal to the row's maximum (-0 == +0). int64 ``[rows]``, CPU."""
    tokens = []
    for row in logits.float().cpu().numpy():
        nan = np.flatnonzero(np.isnan(row))
        tokens.append(nan[0] if nan.size else np.flatnonzero(row == row.max())[0])
    return torch.tensor(tokens, dtype=torch.int64)


POISON_PAD = 16


def poisoned(shape, dtype, device, fill):
    """A contiguous ``shape`` view in the middle of a 1-D buffer filled with ``fill``, and that buffer."""
    numel = math.prod(shape)
    storage = torch.full((numel + 2 * POISON_PAD,), fill, dtype=dtype, device=device)
    return storage[POISON_PAD:POISON_PAD + numel].view(shape), storage


def assert_margins_intact(storage, fill, name):
    margins = torch.cat([storage[:POISON_PAD], storage[-POISON_PAD:]])
    intact = margins.isnan().all() if math.isnan(fill) else (margins == fill).all()
    assert intact, f"{name}: written outside the tensor"


def between_nan_columns(logits):
    """``logits`` as a view with NaN columns on both sides: a read left of column 0 or right of the
    last column would win the argmax."""
    rows, cols = logits.shape
    wide = torch.full((rows, cols + 2 * POISON_PAD), float("nan"), dtype=logits.dtype, device=logits.device)
    wide[:, POISON_PAD:POISON_PAD + cols] = logits
    return wide[:, POISON_PAD:POISON_PAD + cols]


def rank_partials(logits, vocab, tp, split_columns, device, k=None):
    """Every emulated rank's exchange buffer (argmax partials, or top-``k`` partials), each computed into a
    NaN-poisoned view (every slot must be written, nothing around it)."""
    rows, padded = logits.shape
    shard = padded // tp
    splits, _ = exchange_layout(shard, split_columns)
    buffers = []
    for rank in range(tp):
        lanes = 4 if k is None else topk_slot_lanes(k)
        buf, storage = poisoned((rows, tp * splits, lanes), torch.float32, device, float("nan"))
        local = logits[:, rank * shard:(rank + 1) * shard]
        if k is None:
            argmax_partials(local, buf, rank=rank, tp_size=tp, vocab_size=vocab, split_columns=split_columns)
        else:
            topk_partials(local, buf, k=k, rank=rank, tp_size=tp, vocab_size=vocab, split_columns=split_columns)
        assert_margins_intact(storage, float("nan"), f"rank {rank} partials")
        buffers.append(buf)
    return buffers


def emulated_all_reduce(buffers, order, foreign_fill=None):
    """Sum of the rank buffers in ``order``; ``foreign_fill=-0.0`` first rewrites every foreign +0.0 slot."""
    tp = len(buffers)
    splits = buffers[0].shape[1] // tp
    reduced = torch.zeros_like(buffers[0]) if foreign_fill is None else torch.full_like(buffers[0], foreign_fill)
    for rank in order:
        buf = buffers[rank]
        if foreign_fill is not None:
            buf = buf.clone()
            foreign = torch.ones(tp * splits, dtype=torch.bool)
            foreign[rank * splits:(rank + 1) * splits] = False
            buf[:, foreign.to(buf.device)] = foreign_fill
        reduced = reduced + buf
    return reduced


def finalize(reduced, positions=None, token_map=None):
    """draft_finalize into poisoned output views; checks nothing around them is written."""
    rows, device = reduced.shape[0], reduced.device
    tokens, tokens_storage = poisoned((rows,), torch.int64, device, -7)
    topk_p, topk_p_storage = poisoned((rows,), torch.float32, device, float("nan"))
    outputs = [(tokens_storage, -7, "tokens"), (topk_p_storage, float("nan"), "topk_p")]
    positions_out = None
    if positions is not None:
        positions_out, positions_storage = poisoned((rows,), positions.dtype, device, -7)
        outputs.append((positions_storage, -7, "positions_out"))
    draft_finalize(tokens=tokens, topk_p=topk_p, positions=positions, positions_out=positions_out, reduced=reduced,
                   token_map=token_map)
    for storage, fill, name in outputs:
        assert_margins_intact(storage, fill, name)
    return tokens, topk_p, positions_out


def emulate_exchange(logits, vocab, tp, split_columns, device, order=None, positions=None, token_map=None):
    """Partials of every rank, a forward-order sum, finalize: (tokens, topk_p, positions_out, reduced)."""
    buffers = rank_partials(logits, vocab, tp, split_columns, device)
    reduced = emulated_all_reduce(buffers, order or list(range(tp)))
    return (*finalize(reduced, positions, token_map), reduced)


def _orders(tp, seed):
    forward = list(range(tp))
    shuffled = forward[:]
    random.Random(seed).shuffle(shuffled)
    return [(forward, None), (forward[::-1], None), (shuffled, -0.0)]


def check_emulated(vocab, tp, shard, dtype, rows, device, split_columns, seed=0, compare_reference=True):
    logits = between_nan_columns(adversarial_logits(rows, vocab, shard, tp, dtype, seed).to(device))
    check_exchange(logits, vocab, tp, shard, split_columns, seed, compare_reference)


def check_exchange(logits, vocab, tp, shard, split_columns, seed=0, compare_reference=True):
    """The emulated exchange of ``logits`` (``[rows, tp * shard]``) in every order: tokens equal
    ``first_max_index``; with ``compare_reference``, every rank's partials equal the reference's bits."""
    rows, device = logits.shape[0], logits.device
    expected = first_max_index(logits[:, :vocab]).to(device)
    assert torch.equal(torch.argmax(logits[:, :vocab].float(), dim=-1), expected)  # the contract is torch.argmax
    shards = [logits[:, r * shard:(r + 1) * shard] for r in range(tp)]
    assert torch.equal(gathered_argmax_reference(shards, vocab), expected)
    _, split_width = exchange_layout(shard, split_columns)
    positions = torch.arange(rows, dtype=torch.int64, device=device) * 7
    buffers = rank_partials(logits, vocab, tp, split_columns, device)
    for order, fill in _orders(tp, seed):
        reduced = emulated_all_reduce(buffers, order, fill)
        tokens, topk_p, positions_out = finalize(reduced, positions)
        mismatch = (tokens != expected).nonzero().flatten().tolist()
        assert not mismatch, f"rows {mismatch[:8]}: got {tokens[mismatch[:8]].tolist()}, want {expected[mismatch[:8]].tolist()}"
        assert torch.equal(topk_p, torch.ones_like(topk_p))
        assert torch.equal(positions_out, positions + 1)
        if compare_reference and fill is None and order == sorted(order):
            for rank, buf in enumerate(buffers):
                ref = argmax_partials_reference(shards[rank], rank=rank, tp_size=tp, vocab_size=vocab, split_width=split_width)
                assert torch.equal(buf.cpu().view(torch.int32), ref.cpu().view(torch.int32)), f"rank {rank} partials differ"
            ref_tokens, _, _ = argmax_finalize_reference(reduced, positions)
            assert torch.equal(ref_tokens, expected)


# -- order key -----------------------------------------------------------------------------------

def test_order_key_special_values():
    values = torch.tensor([float("-inf"), -1.0, -0.0, 0.0, 1e-45, 1.0, float("inf"), float("nan")])
    keys = order_key_nan_max_zeros_equal(values).tolist()
    assert keys[0] == KEY_NEG_INF
    assert keys[2] == keys[3] == KEY_ZERO
    assert keys[-1] == KEY_NAN
    assert keys[:2] + keys[3:-1] == sorted(keys[:2] + keys[3:-1]) and len(set(keys[3:-1])) == 4
    nans = torch.cat([_from_bits(b, torch.float32) for b in NAN_BITS_FP32])
    assert order_key_nan_max_zeros_equal(nans).tolist() == [KEY_NAN] * len(NAN_BITS_FP32)


def test_order_key_is_monotone_on_random_floats():
    x = torch.randn(4096) * torch.logspace(-40, 38, 4096)
    x = x[torch.isfinite(x)]
    keys = order_key_nan_max_zeros_equal(x)
    order = torch.argsort(x, stable=True)
    assert torch.all(keys[order][1:] >= keys[order][:-1])
    assert torch.equal(keys[:-1] == keys[1:], x[:-1] == x[1:])


# -- layout ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("shard", [1, 63, 64, 65, 127, 128, 129, 4096, 4097, 19360, 77440, 154880])
def test_exchange_layout_covers_the_shard(shard):
    splits, width = exchange_layout(shard)
    assert width % 64 == 0 and splits * width >= shard > (splits - 1) * width
    assert width <= DEFAULT_SPLIT_COLUMNS + 64 or splits == 1


def test_exchange_layout_rejects_bad_sizes():
    with pytest.raises(ValueError, match="shard_size"):
        exchange_layout(0)
    with pytest.raises(ValueError, match="split_columns"):
        exchange_layout(64, 0)


# -- emulated TP, small sizes (CPU interpreter and GPU) --------------------------------------------

SMALL_CASES = [
    # (vocab, tp, shard): odd sizes, edge lengths, empty shards (vocab < (tp - 1) * shard)
    (1, 2, 64), (5, 8, 64), (37, 3, 64), (63, 2, 32), (64, 2, 32), (65, 2, 64), (127, 4, 32), (128, 4, 32),
    (129, 3, 64), (200, 8, 32), (257, 4, 65), (1000, 2, 512), (1000, 8, 128), (777, 3, 259),
    (1, 1, 64), (129, 1, 192), (300, 1, 320),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("vocab,tp,shard", SMALL_CASES, ids=[f"{v}-tp{t}-sh{s}" for v, t, s in SMALL_CASES])
def test_emulated_small(vocab, tp, shard, dtype, device):
    check_emulated(vocab, tp, shard, dtype, rows=16, device=device, split_columns=128, seed=vocab * 31 + tp)


@pytest.mark.parametrize("rows", [1, 2, 63, 64])
def test_emulated_rows(rows, device):
    check_emulated(700, 2, 384, torch.bfloat16, rows=rows, device=device, split_columns=384, seed=rows)



# (vocab, tp, shard, split_columns): splits of several 1024-column blocks (the kernel's block; the
# small cases above have one block a split), the last block of a split partial
MULTI_BLOCK_CASES = [(5000, 2, 2560, DEFAULT_SPLIT_COLUMNS), (8000, 2, 4160, DEFAULT_SPLIT_COLUMNS),
                     (3000, 1, 3000, 2048)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("vocab,tp,shard,split_columns", MULTI_BLOCK_CASES)
def test_emulated_multi_block_splits(vocab, tp, shard, split_columns, dtype, device):
    """Every adversarial row (NaNs among them) over splits of several blocks, exact against the
    reference partials."""
    _, split_width = exchange_layout(shard, split_columns)
    assert split_width > 1024
    check_emulated(vocab, tp, shard, dtype, rows=18, device=device, split_columns=split_columns,
                   seed=shard + tp)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_nan_in_a_later_block_of_a_split(dtype, device):
    """A NaN that is not in the first 1024-column block of its split never wins the lane scan (no
    value compares greater than a NaN, nor a NaN greater than anything): only the rescan of the
    split finds it. NaNs in a later full block, in the partial last block, the first NaN in a later
    block at a lower lane than one further on, a NaN after +inf, and (control) one in the first
    block; two ranks of one 2560-wide split each (three blocks)."""
    vocab, tp, shard = 5100, 2, 2560
    nan_bits = NAN_BITS_FP32 if dtype == torch.float32 else NAN_BITS_BF16
    placements = [[1024 + 7], [2048 + 100], [2048 + 3, 1024 + 900], [1024 + 5], [2000, 100],
                  [shard + 1024 + 1], [shard + 2048 + 400, shard + 1030]]
    logits = torch.randn(len(placements), tp * shard, generator=torch.Generator().manual_seed(3))
    logits = logits.to(dtype)
    logits[3, 3] = float("inf")
    logits[:, vocab:] = float("nan")  # padding: never read
    for row, cols in enumerate(placements):
        for col, bits in zip(cols, nan_bits):
            _put(logits, row, col, bits)
    check_exchange(between_nan_columns(logits.to(device)), vocab, tp, shard, DEFAULT_SPLIT_COLUMNS)


@pytest.mark.parametrize("vocab,tp,dtype", [(154880, 2, torch.bfloat16), (129280, 8, torch.float32),
                                            (151936, 4, torch.bfloat16)])
def test_emulated_full_vocab_cpu_sized(vocab, tp, dtype, device):
    from dsaspec.layers.vocab_parallel import padded_vocab_size

    shard = padded_vocab_size(vocab, tp) // tp
    check_emulated(vocab, tp, shard, dtype, rows=2, device=device, split_columns=DEFAULT_SPLIT_COLUMNS,
                   seed=vocab + tp, compare_reference=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tp", [2, 3, 4, 8])
@pytest.mark.parametrize("vocab", FULL_VOCABS)
def test_emulated_full_vocab_gpu(vocab, tp, dtype):
    from dsaspec.layers.vocab_parallel import padded_vocab_size

    shard = padded_vocab_size(vocab, tp) // tp
    for rows in (1, 7, 64):
        check_emulated(vocab, tp, shard, dtype, rows=rows, device="cuda", split_columns=DEFAULT_SPLIT_COLUMNS,
                       seed=rows * 1000 + tp)


@pytest.mark.gpu
def test_random_bf16_rows_have_ties_and_match():
    # Realistic bf16 logits: a few percent of rows have a tied maximum; all must match torch.argmax.
    from dsaspec.layers.vocab_parallel import padded_vocab_size

    vocab, tp = 154880, 2
    shard = padded_vocab_size(vocab, tp) // tp
    logits = (torch.randn(512, tp * shard, device="cuda") * 3).to(torch.bfloat16)
    full = logits[:, :vocab].float()
    ties = (full == full.max(dim=1, keepdim=True).values).sum(dim=1) > 1
    assert ties.any()
    tokens, *_ = emulate_exchange(logits, vocab, tp, DEFAULT_SPLIT_COLUMNS, "cuda", order=[1, 0])
    assert torch.equal(tokens, torch.argmax(full, dim=-1))


# -- finalize --------------------------------------------------------------------------------------

@pytest.mark.parametrize("map_dtype", [torch.int32, torch.int64])
def test_finalize_reads_token_map_only_inside_it(map_dtype, device):
    # The token_map load is unmasked: with tokens at both ends of the vocab, a map inside a poisoned
    # buffer shows any read outside it, on both paths.
    vocab, rows = 300, 8
    logits = adversarial_logits(rows, vocab, 160, 2, torch.float32, seed=3).to(device)
    logits[0, 0] = logits[1, vocab - 1] = float("inf")
    expected = first_max_index(logits[:, :vocab]).to(device)
    assert expected[0] == 0 and expected[1] == vocab - 1
    token_map, storage = poisoned((vocab,), map_dtype, device, -7)
    token_map.copy_(torch.randperm(vocab, generator=torch.Generator().manual_seed(0)).to(device) * 3 + 1)
    positions = torch.arange(rows, dtype=torch.int32, device=device)
    tokens, _, positions_out, reduced = emulate_exchange(logits, vocab, 2, 128, device, positions=positions,
                                                         token_map=token_map)
    assert torch.equal(tokens, token_map[expected].to(torch.int64))
    assert positions_out.dtype == torch.int32 and torch.equal(positions_out, positions + 1)
    ref_tokens, _, ref_pos = argmax_finalize_reference(reduced, positions, token_map)
    assert torch.equal(ref_tokens, tokens) and torch.equal(ref_pos, positions_out)
    gathered = torch.empty(rows, dtype=torch.int32, device=device)
    draft_finalize(tokens=gathered, topk_p=torch.empty(rows, device=device), argmax_tokens=expected,
                   token_map=token_map)
    assert torch.equal(gathered.to(torch.int64), token_map[expected].to(torch.int64))


def test_finalize_int32_tokens(device):
    logits = adversarial_logits(8, 300, 160, 2, torch.float32, seed=3).to(device)
    *_, reduced = emulate_exchange(logits, 300, 2, 128, device)
    tokens32 = torch.empty(8, dtype=torch.int32, device=device)
    draft_finalize(tokens=tokens32, topk_p=torch.empty(8, device=device), reduced=reduced)
    assert torch.equal(tokens32.to(torch.int64), first_max_index(logits[:, :300]).to(device))


def test_finalize_gather_mode_matches_exchange_mode(device):
    logits = adversarial_logits(16, 500, 256, 2, torch.bfloat16, seed=5).to(device)
    positions = torch.arange(16, dtype=torch.int64, device=device)
    exch_tokens, exch_p, exch_pos, _ = emulate_exchange(logits, 500, 2, 256, device, positions=positions)
    argmax = torch.argmax(logits[:, :500].float(), dim=-1)
    tokens = torch.empty(16, dtype=torch.int64, device=device)
    topk_p = torch.empty(16, device=device)
    positions_out = torch.empty_like(positions)
    draft_finalize(tokens=tokens, topk_p=topk_p, positions=positions, positions_out=positions_out, argmax_tokens=argmax)
    for a, b in ((tokens, exch_tokens), (topk_p, exch_p), (positions_out, exch_pos)):
        assert torch.equal(a, b)
    # In place: positions_out may be positions, argmax_tokens may be tokens.
    draft_finalize(tokens=argmax, topk_p=topk_p, positions=positions, positions_out=positions, argmax_tokens=argmax)
    assert torch.equal(positions, positions_out) and torch.equal(argmax, tokens)


# -- argument checks ---------------------------------------------------------------------------------

def test_partials_argument_errors(device):
    logits = torch.randn(2, 64, device=device)
    splits, _ = exchange_layout(64)
    good = torch.empty(2, 2 * splits, 4, device=device)
    cases = [
        (dict(out=torch.empty(2, 3, 4, device=device)), ValueError,
         rf"out must be a contiguous fp32 tensor of shape \(2, {2 * splits}, 4\), got \(2, 3, 4\)"),
        (dict(out=good.double()), ValueError, "out must be a contiguous fp32 tensor"),
        (dict(rank=2), ValueError, r"rank must be in \[0, tp_size=2\), got 2"),
        (dict(vocab_size=129), ValueError, r"vocab_size must be in \[1, tp_size \* Sh = 128\], got 129"),
        (dict(vocab_size=0), ValueError, r"vocab_size must be in \[1, tp_size \* Sh = 128\], got 0"),
        (dict(local_logits=logits.half()), TypeError, "local_logits must be bf16 or fp32, got torch.float16"),
        (dict(local_logits=torch.randn(64, 2, device=device).t()), ValueError,
         "local_logits must have unit column stride"),
        (dict(local_logits=logits[None]), ValueError, r"local_logits must be \[rows, Sh\] with Sh >= 1"),
        (dict(local_logits=logits[:, :0]), ValueError, r"local_logits must be \[rows, Sh\] with Sh >= 1"),
    ]
    for change, error, message in cases:
        kwargs = dict(local_logits=logits, out=good, rank=0, tp_size=2, vocab_size=100) | change
        with pytest.raises(error, match=message):
            argmax_partials(kwargs.pop("local_logits"), kwargs.pop("out"), **kwargs)


def test_finalize_argument_errors(device):
    tokens = torch.empty(2, dtype=torch.int64, device=device)
    topk_p = torch.empty(2, device=device)
    reduced = torch.zeros(2, 4, 4, device=device)
    argmax = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="pass exactly one of reduced= .exchange path. and argmax_tokens="):
        draft_finalize(tokens=tokens, topk_p=topk_p)
    with pytest.raises(ValueError, match="pass exactly one of reduced="):
        draft_finalize(tokens=tokens, topk_p=topk_p, reduced=reduced, argmax_tokens=argmax)
    with pytest.raises(ValueError, match="pass both positions= and positions_out=, or neither"):
        draft_finalize(tokens=tokens, topk_p=topk_p, reduced=reduced, positions=tokens)
    with pytest.raises(ValueError, match="topk_p must be a contiguous 1-D tensor"):
        draft_finalize(tokens=tokens, topk_p=topk_p.double(), reduced=reduced)
    with pytest.raises(ValueError, match="tokens must be a contiguous 1-D tensor"):
        draft_finalize(tokens=tokens.float(), topk_p=topk_p, reduced=reduced)
    with pytest.raises(ValueError, match="positions_out must be a contiguous 1-D tensor"):
        draft_finalize(tokens=tokens, topk_p=topk_p, reduced=reduced, positions=tokens, positions_out=topk_p)
    with pytest.raises(ValueError, match="argmax_tokens must be a contiguous 1-D tensor"):
        draft_finalize(tokens=tokens, topk_p=topk_p, argmax_tokens=torch.zeros(4, dtype=torch.int64)[::2])
    with pytest.raises(ValueError, match=r"reduced must be fp32 \[2, slots, 4\] with dense slots, got \(2, 4, 3\)"):
        draft_finalize(tokens=tokens, topk_p=topk_p, reduced=torch.zeros(2, 4, 3, device=device))
    with pytest.raises(ValueError, match=r"reduced must be fp32 \[2, slots, 4\] with dense slots, got \(3, 4, 4\)"):
        draft_finalize(tokens=tokens, topk_p=topk_p, reduced=torch.zeros(3, 4, 4, device=device))
    with pytest.raises(ValueError, match="token_map must be a contiguous 1-D int32/int64 tensor"):
        draft_finalize(tokens=tokens, topk_p=topk_p, reduced=reduced,
                       token_map=torch.arange(20, device=device)[::2])
    with pytest.raises(ValueError, match="token_map must be a contiguous 1-D int32/int64 tensor"):
        draft_finalize(tokens=tokens, topk_p=topk_p, reduced=reduced, token_map=torch.zeros(8, device=device))


# -- top-k exchange with probability lanes ------------------------------------------------------------

# The documented accuracy (docs/argmax-exchange.md) against the softmax of the gathered fp32 logits computed
# exactly (float64): |p - p*| <= P_REL * p* + P_ABS (the absolute term covers subnormal probabilities);
# the log-sum-exp within LSE_REL * max(1, |lse*|).
P_REL, P_ABS, LSE_REL = 2.0**-18, 2.0**-126, 2.0**-18
ADVERSARIAL_ROWS = 18  # one row per case of adversarial_logits
# Under the interpreter numpy warns when a difference of ±3e38 logits overflows to -inf (exp gives 0, as on GPU).
NUMPY_OVERFLOW = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def stable_topk_oracle(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The top-k contract written without an order key or torch.sort: per row, the NaN columns first (in
    column order), then the others by value descending, lowest column first among equal values (-0 == +0);
    the first ``k``. int64 ``[rows, k]``, CPU."""
    out = []
    for row in logits.float().cpu().numpy():
        nan = np.flatnonzero(np.isnan(row))
        rest = np.flatnonzero(~np.isnan(row))
        rest = rest[np.lexsort((rest, -row[rest]))]
        out.append(np.concatenate([nan, rest])[:k])
    return torch.tensor(np.array(out), dtype=torch.int64)


def finalize_topk(reduced, k):
    """topk_finalize into [rows, k] views of wider poisoned buffers; checks nothing around them is written."""
    rows, device = reduced.shape[0], reduced.device
    wide_index, index_storage = poisoned((rows, k + 3), torch.int64, device, -7)
    wide_p, p_storage = poisoned((rows, k + 3), torch.float32, device, -7.0)
    lse, lse_storage = poisoned((rows,), torch.float32, device, -7.0)
    topk_finalize(reduced, k=k, topk_index=wide_index[:, :k], topk_p=wide_p[:, :k], lse=lse)
    for storage, name in ((index_storage, "topk_index"), (p_storage, "topk_p"), (lse_storage, "lse")):
        assert_margins_intact(storage, -7, name)
    assert (wide_index[:, k:] == -7).all() and (wide_p[:, k:] == -7).all(), "written past column k"
    return wide_index[:, :k], wide_p[:, :k], lse


def probability_errors(topk_p, logits, topk_index, lse=None):
    """Asserts the NaN / ±inf rules and the documented bounds of ``topk_p`` (and ``lse``) against the exact
    softmax (float64) of the fp32 ``logits``; returns the max relative errors of topk_p (probabilities >=
    2**-126) and of lse (0.0 without it)."""
    exact = torch.softmax(logits.double(), dim=-1).gather(1, topk_index)
    fp32 = torch.softmax(logits.float(), dim=-1).gather(1, topk_index)
    nan = exact.isnan()
    assert torch.equal(topk_p.isnan(), nan) and torch.equal(fp32.isnan(), nan)
    p = topk_p.double()[~nan]
    err = (p - exact[~nan]).abs()
    bound = P_REL * exact[~nan] + P_ABS
    assert (err <= bound).all(), f"probability error {(err / bound).max().item():.2f}x the bound"
    normal = exact[~nan] >= P_ABS
    rel_p = (err[normal] / exact[~nan][normal]).max().item() if normal.any() else 0.0
    if lse is None:
        return rel_p, 0.0
    exact_lse = torch.logsumexp(logits.double(), dim=-1)
    finite = torch.isfinite(exact_lse)
    assert torch.equal(lse[~finite].double().nan_to_num(0.5), exact_lse[~finite].nan_to_num(0.5))
    lse_err = ((lse.double() - exact_lse).abs() / exact_lse.abs().clamp(min=1.0))[finite]
    assert (lse_err <= LSE_REL).all(), f"lse error {lse_err.max().item()}"
    return rel_p, lse_err.max().item() if finite.any() else 0.0


def check_topk_emulated(vocab, tp, shard, dtype, k, rows, device, split_columns, seed, compare_reference=True):
    """Emulated TP top-k exchange against the stable top-k and the exact softmax; with ``compare_reference``
    also the numpy oracle (slow at full vocab) and the reference partials / finalize. Returns the
    probabilities' max relative errors (topk_p, lse)."""
    logits = between_nan_columns(adversarial_logits(rows, vocab, shard, tp, dtype, seed).to(device))
    full = logits[:, :vocab].float()
    expected = stable_topk_reference(full, k)
    if compare_reference:
        assert torch.equal(stable_topk_oracle(full, k).to(device), expected)  # the reference states the contract
    buffers = rank_partials(logits, vocab, tp, split_columns, device, k=k)
    order = list(range(tp))
    random.Random(seed).shuffle(order)
    reduced = emulated_all_reduce(buffers, order, foreign_fill=-0.0)
    index, topk_p, lse = finalize_topk(reduced, k)
    mismatch = (index != expected).any(dim=1).nonzero().flatten().tolist()
    assert not mismatch, f"rows {mismatch[:8]}: got {index[mismatch[:8]].tolist()}, want {expected[mismatch[:8]].tolist()}"
    errors = probability_errors(topk_p, full, index, lse)
    if compare_reference:
        _, split_width = exchange_layout(shard, split_columns)
        for rank, buf in enumerate(buffers):
            ref = topk_partials_reference(logits[:, rank * shard:(rank + 1) * shard], k=k, rank=rank, tp_size=tp,
                                          vocab_size=vocab, split_width=split_width)
            buf, ref = buf.cpu(), ref.cpu()
            assert torch.equal(buf[..., :4 * k].view(torch.int32), ref[..., :4 * k].view(torch.int32)), \
                f"rank {rank} candidates differ"
            s, s_ref = buf[..., 4 * k].double(), ref[..., 4 * k].double()
            assert torch.equal(s == 0, s_ref == 0) and ((s - s_ref).abs() <= P_REL * s_ref).all(), \
                f"rank {rank} sums of exponentials differ"
        ref_index, ref_p, ref_lse = topk_finalize_reference(reduced, k)
        assert torch.equal(ref_index, expected)
        probability_errors(ref_p, full, ref_index, ref_lse)
    return errors


TOPK_CASES = [
    # (vocab, tp, shard, k, split_columns, dtype): TP 1/2/3/4/8, several splits, empty shards, k up to 8
    (300, 1, 320, 8, 160, torch.bfloat16), (200, 2, 128, 4, 64, torch.float32), (257, 3, 96, 3, 96, torch.bfloat16),
    (129, 4, 64, 2, 64, torch.float32), (37, 8, 32, 1, 32, torch.bfloat16),
]


@NUMPY_OVERFLOW
@pytest.mark.parametrize("vocab,tp,shard,k,split_columns,dtype", TOPK_CASES,
                         ids=[f"{v}-tp{t}-sh{s}-k{k}" for v, t, s, k, _, _ in TOPK_CASES])
def test_topk_emulated_small(vocab, tp, shard, k, split_columns, dtype, device):
    check_topk_emulated(vocab, tp, shard, dtype, k, ADVERSARIAL_ROWS, device, split_columns, seed=vocab + k)


@NUMPY_OVERFLOW
def test_topk_k1_candidates_are_the_argmax_candidates(device):
    logits = adversarial_logits(ADVERSARIAL_ROWS, 250, 128, 2, torch.bfloat16, seed=11).to(device)
    argmax = rank_partials(logits, 250, 2, 128, device)
    top1 = rank_partials(logits, 250, 2, 128, device, k=1)
    for a, b in zip(argmax, top1):
        assert torch.equal(a.view(torch.int32), b[..., :4].contiguous().view(torch.int32))


@NUMPY_OVERFLOW
def test_topk_full_vocab_cpu_sized(device):
    from dsaspec.layers.vocab_parallel import padded_vocab_size

    vocab, tp = 154880, 2
    shard = padded_vocab_size(vocab, tp) // tp
    check_topk_emulated(vocab, tp, shard, torch.bfloat16, 4, 2, device, TOPK_SPLIT_COLUMNS, seed=1,
                        compare_reference=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("vocab", FULL_VOCABS)
def test_topk_full_vocab_gpu(vocab, tp, k, dtype):
    from dsaspec.layers.vocab_parallel import padded_vocab_size

    shard = padded_vocab_size(vocab, tp) // tp
    worst = (0.0, 0.0)
    for rows in (ADVERSARIAL_ROWS, 64, 256):
        errors = check_topk_emulated(vocab, tp, shard, dtype, k, rows, "cuda", TOPK_SPLIT_COLUMNS,
                                     seed=rows * 100 + tp, compare_reference=rows == ADVERSARIAL_ROWS)
        worst = tuple(map(max, worst, errors))
    print(f"\ntopk_p max relative error {worst[0]:.3g} ({worst[0] / 2**-24:.1f} ulp), lse {worst[1]:.3g}")


def test_topk_argument_errors(device):
    logits = torch.randn(2, 64, device=device)
    splits, _ = exchange_layout(64, 64)
    good = torch.empty(2, 2 * splits, topk_slot_lanes(4), device=device)
    cases = [
        (dict(k=0), r"k must be in \[1, min\(TOPK_MAX=8, vocab_size=100\)\], got 0"),
        (dict(k=9), r"k must be in \[1, min\(TOPK_MAX=8, vocab_size=100\)\], got 9"),
        (dict(k=4, vocab_size=3), r"k must be in \[1, min\(TOPK_MAX=8, vocab_size=3\)\], got 4"),
        (dict(split_columns=TOPK_SPLIT_COLUMNS + 1), r"split_columns must be in \[1, TOPK_SPLIT_COLUMNS=8192\]"),
        (dict(out=torch.empty(2, 2 * splits, 4, device=device)),
         rf"out must be a contiguous fp32 tensor of shape \(2, {2 * splits}, 17\)"),
    ]
    for change, message in cases:
        kwargs = dict(out=good, k=4, rank=0, tp_size=2, vocab_size=100, split_columns=64) | change
        with pytest.raises(ValueError, match=message):
            topk_partials(logits, kwargs.pop("out"), **kwargs)
    reduced = torch.zeros(2, 3, 17, device=device)
    index = torch.empty(2, 4, dtype=torch.int64, device=device)
    p = torch.empty(2, 4, device=device)
    with pytest.raises(ValueError, match=r"k must be in \[1, TOPK_MAX=8\], got 9"):
        topk_finalize(reduced, k=9, topk_index=index, topk_p=p)
    with pytest.raises(ValueError, match=r"reduced must be fp32 \[rows, slots, 13\] with dense slots"):
        topk_finalize(reduced, k=3, topk_index=index, topk_p=p)
    with pytest.raises(ValueError, match=r"topk_index must be torch.int64 \[2, 4\] with unit column stride"):
        topk_finalize(reduced, k=4, topk_index=index.t().contiguous().t(), topk_p=p)
    with pytest.raises(ValueError, match=r"topk_p must be torch.float32 \[2, 4\]"):
        topk_finalize(reduced, k=4, topk_index=index, topk_p=p.double())
    with pytest.raises(ValueError, match=r"lse must be a contiguous fp32 \[2\]"):
        topk_finalize(reduced, k=4, topk_index=index, topk_p=p, lse=torch.empty(3, device=device))


# -- CUDA graphs (one GPU, emulated ranks) -----------------------------------------------------------

@pytest.mark.gpu
def test_partials_and_finalize_in_cuda_graph():
    vocab, tp, rows = 129280, 8, 16
    from dsaspec.layers.vocab_parallel import padded_vocab_size

    shard = padded_vocab_size(vocab, tp) // tp
    splits, _ = exchange_layout(shard)
    logits = torch.empty(rows, tp * shard, dtype=torch.bfloat16, device="cuda")
    buffers = torch.empty(tp, rows, tp * splits, 4, device="cuda")
    tokens = torch.empty(rows, dtype=torch.int64, device="cuda")
    topk_p = torch.empty(rows, device="cuda")
    positions = torch.zeros(rows, dtype=torch.int64, device="cuda")
    positions_out = torch.empty_like(positions)

    def step():
        for rank in range(tp):
            argmax_partials(logits[:, rank * shard:(rank + 1) * shard], buffers[rank], rank=rank, tp_size=tp,
                            vocab_size=vocab)
        draft_finalize(tokens=tokens, topk_p=topk_p, positions=positions, positions_out=positions_out,
                       reduced=buffers.sum(dim=0))

    logits.copy_(adversarial_logits(rows, vocab, shard, tp, torch.bfloat16, seed=0))
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        logits.copy_(adversarial_logits(rows, vocab, shard, tp, torch.bfloat16, seed=seed + 1))
        positions.fill_(seed)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(tokens, torch.argmax(logits[:, :vocab].float(), dim=-1))
        assert torch.equal(positions_out, positions + 1)



@pytest.mark.gpu
@pytest.mark.parametrize("k", [2, 8])
def test_topk_partials_and_finalize_in_cuda_graph(k):
    from dsaspec.layers.vocab_parallel import padded_vocab_size

    vocab, tp, rows = 154880, 4, 64
    shard = padded_vocab_size(vocab, tp) // tp
    splits, _ = exchange_layout(shard, TOPK_SPLIT_COLUMNS)
    logits = torch.empty(rows, tp * shard, dtype=torch.bfloat16, device="cuda")
    buffers = torch.empty(tp, rows, tp * splits, topk_slot_lanes(k), device="cuda")
    index = torch.empty(rows, k, dtype=torch.int64, device="cuda")
    topk_p = torch.empty(rows, k, device="cuda")
    lse = torch.empty(rows, device="cuda")

    def step():
        for rank in range(tp):
            topk_partials(logits[:, rank * shard:(rank + 1) * shard], buffers[rank], k=k, rank=rank, tp_size=tp,
                          vocab_size=vocab)
        topk_finalize(buffers.sum(dim=0), k=k, topk_index=index, topk_p=topk_p, lse=lse)

    logits.copy_(adversarial_logits(rows, vocab, shard, tp, torch.bfloat16, seed=0))
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        logits.copy_(adversarial_logits(rows, vocab, shard, tp, torch.bfloat16, seed=seed + 1))
        graph.replay()
        torch.cuda.synchronize()
        full = logits[:, :vocab].float()
        assert torch.equal(index, stable_topk_oracle(full, k).cuda())
        probability_errors(topk_p, full, index, lse)
