"""topk_slots: exact against the stable-sort reference, and a top-k set by torch.topk's standard;
rows with live <= k take every live position without reading logits. Both forms: one program per
row (no workspace) and the chunked form (a workspace of P chunks per row, P forced), the latter in
five launches (everywhere) and in one cooperative launch (on the GPU)."""

import ast
import inspect
import os

import pytest
import torch

from dsa_inputs import POISON_SLOT
from dsaspec.ops import topk as topk_module
from dsaspec.ops.topk import (TOPK_COUNTER_WORDS, TOPK_WORKSPACE_WORDS, topk_candidates,
                              topk_candidates_width, topk_num_chunks, topk_sampled_min_live,
                              topk_slots, topk_workspace)
from dsaspec.reference.topk import float_order_key, reference_topk_positions, reference_topk_slots


def _inputs(logits, seqlens, width, seed=0, num_slots=1000):
    """Page table with random (repeating) live slots and poisoned tails; logits poisoned past the
    live length with values that would win the selection if read."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(seqlens)
    page_table = torch.full((rows, width), POISON_SLOT, dtype=torch.int32)
    logits = logits.clone()
    for row, length in enumerate(seqlens):
        page_table[row, :length] = torch.randint(0, num_slots, (length,), generator=gen,
                                                 dtype=torch.int32)
        logits[row, length:] = float("inf")
    return logits, torch.tensor(seqlens, dtype=torch.int32), page_table


def _garbage_workspace(rows, num_chunks, device):
    """A workspace of ``num_chunks`` chunks per row holding junk, but for the barrier counter
    (zero, as topk_workspace leaves it and every call keeps it): no other value is needed."""
    if num_chunks is None:
        return None
    workspace = topk_workspace(rows, device, num_chunks=num_chunks)
    gen = torch.Generator().manual_seed(num_chunks)
    workspace.copy_(torch.randint(-2**31, 2**31 - 1, workspace.shape, generator=gen,
                                  dtype=torch.int32))
    workspace[:, 0, TOPK_COUNTER_WORDS] = 0
    return workspace


def _run(logits, seqlens, page_table, k, device, check_values=True, baseline_read_short_rows=False,
         workspace=None, single_launch=None, candidates=None):
    out = torch.full((logits.shape[0], k), -7, dtype=torch.int32, device=device)
    positions = torch.full_like(out, -7)
    topk_slots(logits.to(device), seqlens.to(device), page_table.to(device), k, out,
               check_values=check_values, out_positions=positions,
               baseline_read_short_rows=baseline_read_short_rows, workspace=workspace, single_launch=single_launch,
               candidates=candidates)
    if workspace is not None:
        assert not workspace[:, 0, TOPK_COUNTER_WORDS].any(), "barrier counter left non-zero"
    return out.cpu(), positions.cpu()


def _assert_topk(logits, seqlens, page_table, k, device, baseline_read_short_rows=False, num_chunks=None,
                 single_launch=None, candidates=None):
    workspace = _garbage_workspace(logits.shape[0], num_chunks, device)
    out, positions = _run(logits, seqlens, page_table, k, device,
                          baseline_read_short_rows=baseline_read_short_rows, workspace=workspace,
                          single_launch=single_launch, candidates=candidates)
    want_positions = reference_topk_positions(logits, seqlens, k)
    assert torch.equal(positions.long(), want_positions)
    assert torch.equal(out, reference_topk_slots(logits, seqlens, page_table, k))
    _assert_topk_set(logits, seqlens, positions, k)
    return positions


def _assert_topk_set(logits, seqlens, positions, k):
    """By torch.topk's standard, allowing any choice among values tied at the k-th."""
    for row, length in enumerate(seqlens.clamp(min=0).tolist()):
        chosen = positions[row][positions[row] >= 0].long()
        assert chosen.numel() == min(length, k)
        assert chosen.unique().numel() == chosen.numel()
        assert torch.all(chosen < length)
        if length > k:
            live = logits[row, :length]
            kth = torch.topk(live, k).values[-1]
            assert torch.all(live[chosen] >= kth)
            assert torch.sum(live > kth) <= chosen.numel()
            assert torch.all(torch.isin(torch.nonzero(live > kth).flatten(), chosen))


EDGE_LENGTHS = [0, 1, 63, 64, 65, 127, 128, 129]


@pytest.mark.parametrize("baseline_read_short_rows", [False, True])
@pytest.mark.parametrize("k", [1, 64, 100])
def test_edge_lengths_random_logits(k, baseline_read_short_rows, device):
    seqlens = EDGE_LENGTHS + [k - 1, k, k + 1, 300, 5]
    gen = torch.Generator().manual_seed(k)
    logits, seqlens, page_table = _inputs(torch.randn(len(seqlens), 320, generator=gen), seqlens,
                                          width=310, seed=k)
    _assert_topk(logits, seqlens, page_table, k, device, baseline_read_short_rows=baseline_read_short_rows)


@pytest.mark.parametrize("k, num_chunks", [(64, None), (130, None), (64, 3)])
def test_short_rows_ignore_logits(k, num_chunks, device):
    """Rows with live <= k (the indexer skips them, so their logits are whatever the buffer
    held: NaN here) take every live position in order; longer rows are unaffected."""
    seqlens = [0, 1, 63, 64, 65, 129, 130, 131, 300, k]
    gen = torch.Generator().manual_seed(k)
    logits, seqlens, page_table = _inputs(torch.randn(len(seqlens), 320, generator=gen),
                                          seqlens, width=300, seed=k)
    fresh = logits.clone()
    short = seqlens <= k
    fresh[short] = float("nan")
    out, positions = _run(fresh, seqlens, page_table, k, device,
                          workspace=_garbage_workspace(len(seqlens), num_chunks, device))
    assert torch.equal(out, reference_topk_slots(logits, seqlens, page_table, k))
    for row in torch.nonzero(short).flatten().tolist():
        length = int(seqlens[row])
        assert positions[row, :length].tolist() == list(range(length))
        assert torch.all(positions[row, length:] == -1) and torch.all(out[row, length:] == -1)
        assert torch.equal(out[row, :length], page_table[row, :length])


@pytest.mark.parametrize("values", [1, 2, 7])
def test_heavy_ties(values, device):
    """Few distinct values: the threshold bin is all ties, and ties go to the lowest positions."""
    gen = torch.Generator().manual_seed(values)
    seqlens = [65, 200, 129, 64]
    logits = torch.randint(0, values, (4, 256), generator=gen).float() - 3.0
    logits, seqlens, page_table = _inputs(logits, seqlens, width=256)
    _assert_topk(logits, seqlens, page_table, 64, device)


def test_close_values_need_every_digit(device):
    """Values one ulp apart share their top 24 bits: the search runs all four digit passes."""
    base = torch.tensor(1.5).view(torch.int32)
    gen = torch.Generator().manual_seed(0)
    bits = base + torch.randperm(250, generator=gen).to(torch.int32)
    logits = torch.stack([bits.view(torch.float32), -bits.view(torch.float32)])
    assert torch.unique(float_order_key(logits[0]) >> 8).numel() <= 2
    logits, seqlens, page_table = _inputs(logits, [250, 250], width=250)
    _assert_topk(logits, seqlens, page_table, 64, device)


def test_special_values(device):
    """Infinities, signed zeros, NaN: ordered by bit pattern like the reference's key."""
    row = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0, 3.0] * 20)
    logits = torch.stack([row, -row, row.flip(0)])
    logits, seqlens, page_table = _inputs(logits, [160, 160, 100], width=160)
    out, positions = _run(logits, seqlens, page_table, 64, device)
    assert torch.equal(positions.long(), reference_topk_positions(logits, seqlens, 64))


@pytest.mark.parametrize("seed", range(3))
def test_random_rows(seed, device):
    gen = torch.Generator().manual_seed(seed)
    rows = 7
    seqlens = torch.randint(0, 1200, (rows,), generator=gen).tolist()
    scale = [1.0, 1e-3, 1e6][seed]
    logits = torch.randn(rows, 1200, generator=gen) * scale
    logits, seqlens, page_table = _inputs(logits, seqlens, width=1200, seed=seed)
    _assert_topk(logits, seqlens, page_table, 64, device)


def test_no_positions_buffer(device):
    gen = torch.Generator().manual_seed(5)
    logits, seqlens, page_table = _inputs(torch.randn(3, 200, generator=gen), [200, 10, 0],
                                          width=200)
    out = torch.zeros(3, 32, dtype=torch.int32, device=device)
    topk_slots(logits.to(device), seqlens.to(device), page_table.to(device), 32, out)
    assert torch.equal(out.cpu(), reference_topk_slots(logits, seqlens, page_table, 32))


def test_bad_arguments(device):
    logits = torch.zeros(2, 16, device=device)
    seqlens = torch.tensor([3, 20], dtype=torch.int32, device=device)
    table = torch.zeros(2, 32, dtype=torch.int32, device=device)
    out = torch.zeros(2, 4, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"logits: width 16 is smaller than the longest row "
                                         r"\(20 live tokens\)"):
        topk_slots(logits, seqlens, table, 4, out)
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 5\), got \(2, 4\)"):
        topk_slots(torch.zeros(2, 32, device=device), seqlens, table, 5, out)
    with pytest.raises(ValueError, match="k: expected >= 1, got 0"):
        topk_slots(torch.zeros(2, 32, device=device), seqlens, table, 0, out)
    with pytest.raises(ValueError, match="seqlens: expected dtype torch.int32, got torch.int64"):
        topk_slots(torch.zeros(2, 32, device=device), seqlens.long(), table, 4, out)
    with pytest.raises(ValueError, match=r"out_positions: expected shape \(2, 4\)"):
        topk_slots(torch.zeros(2, 32, device=device), seqlens, table, 4, out,
                   out_positions=out[:1])
    # check_values=False skips only the checks that read device data
    with pytest.raises(ValueError, match="logits: expected dtype torch.float32"):
        topk_slots(torch.zeros(2, 32, device=device).half(), seqlens, table, 4, out,
                   check_values=False)


# One program per row with candidate lists (the sampled form): rows of at least
# topk_sampled_min_live(k) positions select from the positions at or above a sample's bound; the
# list may hold any junk on entry. Under the interpreter the sample is every 4th position.
JUNK = -5


def _junk_candidates(rows, k, device, num_chunks=1):
    candidates = topk_candidates(rows, k, device, num_chunks=num_chunks)
    candidates.fill_(JUNK)
    return candidates


def _listed(candidates, row, num_chunks=1, chunk=0, logits=None):
    """The positions a call wrote to ``row``'s list (the first half of ``chunk``'s region with
    ``num_chunks`` regions per row; the junk left is never a position). With ``logits``, also
    checks that the second half holds their logits, bit for bit, beside them."""
    region = candidates.shape[1] // num_chunks
    capacity = region // 2
    entries = candidates[row, chunk * region:(chunk + 1) * region].cpu()
    positions = entries[:capacity]
    written = positions != JUNK
    if logits is not None:
        want = logits[row].cpu()[positions[written].long()].view(torch.int32)
        assert torch.equal(entries[capacity:][written], want), f"row {row}: listed logits differ"
    return positions[written]


@pytest.mark.parametrize("k", [1, 16, 64])
def test_sampled_edge_lengths(k, device):
    """Rows around the sampled form's shortest length and much longer, next to rows that copy or
    take the whole-row passes: exact, lists written only for the long rows, each list ascending
    and holding the row's whole selection."""
    shortest = topk_sampled_min_live(k, device)
    lengths = [0, 1, k, k + 1, shortest - 1, shortest, shortest + 1, 2 * shortest + 3]
    gen = torch.Generator().manual_seed(k)
    logits = torch.randn(len(lengths), max(lengths), generator=gen)
    logits[:, ::9] = torch.round(logits[:, ::9])  # ties
    logits, seqlens, page_table = _inputs(logits, lengths, width=max(lengths) + 7)
    candidates = _junk_candidates(len(lengths), k, device)
    positions = _assert_topk(logits, seqlens, page_table, k, device, candidates=candidates)
    for row, length in enumerate(lengths):
        listed = _listed(candidates, row, logits=logits)
        if length < shortest:
            assert listed.numel() == 0, f"row {row} ({length} live) wrote a candidate list"
            continue
        chosen = positions[row][positions[row] >= 0]
        assert k <= listed.numel() <= candidates.shape[1] // 2
        assert bool((listed[1:] > listed[:-1]).all()) and 0 <= listed.min() and listed.max() < length
        assert bool(torch.isin(chosen, listed).all()), f"row {row}: a selected position is not listed"


def test_sampled_falls_back_when_the_sample_misleads(device):
    """Every sampled position holds a larger logit than any other: the bound then admits fewer
    than k positions (the sample's own top ranks), so the row takes the whole-row passes; and a
    row of equal logits lists more than the capacity: the same. Both exact."""
    k = 64
    stride = topk_module._sample_stride(device)
    length = topk_sampled_min_live(k, device) + 3
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, length, generator=gen)
    # distinct integers far above the rest: the bound's bin (16 bits) holds one sampled key
    logits[0, ::stride] = 100.0 + torch.arange(logits[0, ::stride].numel()).float()
    logits[1] = 0.75
    logits, seqlens, page_table = _inputs(logits, [length, length], width=length)
    candidates = _junk_candidates(2, k, device)
    _assert_topk(logits, seqlens, page_table, k, device, candidates=candidates)
    assert 0 < _listed(candidates, 0).numel() < k
    assert _listed(candidates, 1).numel() == candidates.shape[1] // 2  # filled up: over capacity


def test_sampled_special_values(device):
    """NaNs of both signs, infinities, -0.0 / +0.0 and denormals in long rows: the same order as
    the whole-row passes (by bit pattern)."""
    k = 16
    length = topk_sampled_min_live(k, device) * 2
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, length, generator=gen)
    specials = _floats([0x7FC00000, 0xFFC00000, 0x7F800000, 0xFF800000, 0x80000000, 0x00000000,
                        0x00000001, 0x80000001])
    for row in range(3):
        where = torch.randint(0, length, (40,), generator=gen)
        logits[row, where] = specials[torch.randint(0, len(specials), (40,), generator=gen)]
    logits[2].abs_()  # positives only: the specials then sit at the top
    logits, seqlens, page_table = _inputs(logits, [length, length - 1, length], width=length)
    out, positions = _run(logits, seqlens, page_table, k, device,
                          candidates=_junk_candidates(3, k, device))
    assert torch.equal(positions.long(), reference_topk_positions(logits, seqlens, k))
    assert torch.equal(out, reference_topk_slots(logits, seqlens, page_table, k))


def test_candidates_size_and_bad_candidates(device):
    assert topk_candidates(3, 16, device).shape == (3, topk_candidates_width(16, device))
    capacity = 2 * (96 + topk_module.SAMPLE_MARGIN) * 32
    assert topk_module.topk_list_capacity(2048, "cuda") == capacity
    assert topk_candidates_width(2048, "cuda") == 2 * capacity  # positions, then their logits
    assert topk_sampled_min_live(2048, "cuda") == 2 * capacity
    assert topk_sampled_min_live(2048, "cuda", num_chunks=2) == 2 * capacity
    assert topk_sampled_min_live(2048, "cuda", num_chunks=8) == 8 * 2048  # chunks of >= 2048
    logits = torch.zeros(2, 32, device=device)
    seqlens = torch.tensor([3, 20], dtype=torch.int32, device=device)
    table = torch.zeros(2, 32, dtype=torch.int32, device=device)
    out = torch.zeros(2, 4, dtype=torch.int32, device=device)
    good = topk_candidates(2, 4, device)
    assert topk_candidates(2, 4, device, num_chunks=3).shape == (2, 3 * good.shape[1])
    most = topk_module.TOPK_LISTS_MAX_CHUNKS
    assert topk_candidates(2, 4, device, num_chunks=most).shape == (2, most * good.shape[1])
    assert topk_candidates(2, 4, device, num_chunks=most + 1) is None  # few rows: no lists
    with pytest.raises(ValueError, match=r"candidates: expected at least 2 k = 8 columns per chunk "
                                         r"\(k positions and their logits\), 24 for 3 chunks "
                                         r"\(topk_candidates\(\.\.\., num_chunks=3\)\), got "
                                         r"shape \(2, 23\)"):
        topk_slots(logits, seqlens, table, 4, out, candidates=good[:, :23],
                   workspace=topk_workspace(2, device, num_chunks=3))
    with pytest.raises(ValueError, match="candidates: not with baseline_read_short_rows"):
        topk_slots(logits, seqlens, table, 4, out, candidates=good, baseline_read_short_rows=True)
    with pytest.raises(ValueError, match=r"candidates: expected at least 2 k = 8 columns \(k "
                                         r"positions and their logits; topk_candidates\), got "
                                         r"shape \(2, 7\)"):
        topk_slots(logits, seqlens, table, 4, out, candidates=good[:, :7])
    with pytest.raises(ValueError, match="candidates: the last dimension must be contiguous"):
        topk_slots(logits, seqlens, table, 4, out, candidates=good.t().contiguous().t())
    with pytest.raises(ValueError, match="candidates: expected dtype torch.int32, got torch.int64"):
        topk_slots(logits, seqlens, table, 4, out, candidates=good.long())
    with pytest.raises(ValueError, match=r"candidates: expected shape \(2, '\*'\), got \(1, "):
        topk_slots(logits, seqlens, table, 4, out, candidates=good[:1])
    with pytest.raises(ValueError, match="k: expected >= 1, got 0"):
        topk_candidates(2, 0, device)
    with pytest.raises(ValueError, match="num_chunks: expected >= 1, got 0"):
        topk_candidates(2, 4, device, num_chunks=0)


# The chunked form. Under the interpreter a chunk is at least 16 positions (a multiple of 16) and
# the loop step is 32, so these rows cover chunks shorter than a step, several steps per chunk,
# empty chunks and lengths not divisible by P.
CHUNKS = [1, 2, 3, 5]


def _floats(bits):
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("k, num_chunks", [(40, p) for p in CHUNKS] + [(1, 3)])
def test_chunked_edge_lengths(k, num_chunks, device):
    seqlens = [0, 1, k - 1, k, k + 1, 17, 63, 64, 65, 129, 250, 0]
    gen = torch.Generator().manual_seed(k + num_chunks)
    logits, seqlens, page_table = _inputs(torch.randn(len(seqlens), 256, generator=gen), seqlens,
                                          width=260, seed=k)
    seqlens[-1] = -3  # counts as 0
    _assert_topk(logits, seqlens, page_table, k, device, num_chunks=num_chunks)


@pytest.mark.parametrize("num_chunks", CHUNKS)
def test_chunked_ties_and_special_values(num_chunks, device):
    """Ties spanning chunks (all equal; the k-th tie in a middle chunk after entries above it in
    the last chunk), few distinct values, and infinities, signed zeros and NaNs of both signs."""
    k, width = 32, 100
    sparse_ties = torch.where(torch.arange(width) % 2 == 1, 1.0, 0.0)
    sparse_ties[96:] = 3.0  # 4 above, then the 28th tie of 48 (position 55) is the last taken
    few_above = torch.ones(width)
    few_above[[90, 95, 99]] = 2.0
    special = _floats([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
                       0x3F800000, 0xBF800000] * 13)[:width]
    gen = torch.Generator().manual_seed(num_chunks)
    logits = torch.stack([torch.ones(width), torch.ones(width), few_above, sparse_ties,
                          torch.randint(0, 3, (width,), generator=gen).float(), special,
                          -special, special.flip(0)])
    logits, seqlens, page_table = _inputs(logits, [100, 33, 100, 100, 97, 100, 100, 81],
                                          width=width)
    out, positions = _run(logits, seqlens, page_table, k, device,
                          workspace=_garbage_workspace(len(seqlens), num_chunks, device))
    # (NaNs rank by sign bit here, not as torch.topk ranks them: the reference only)
    assert torch.equal(positions.long(), reference_topk_positions(logits, seqlens, k))
    assert torch.equal(out, reference_topk_slots(logits, seqlens, page_table, k))


@pytest.mark.parametrize("num_chunks", CHUNKS)
def test_chunked_stops_after_each_digit(num_chunks, device):
    """k entries alone in their bin of digit 0, 1 or 2: the search stops after 1, 2 or 3 digits;
    entries that differ only in the low byte (or not at all) need all 4. Checked through the
    search state the passes leave in the workspace (digits found by pass 3, still searching)."""
    k, width = 8, 100
    special_positions = [3, 17, 30, 45, 61, 77, 88, 99]  # spread over the chunks

    def row(others, special):
        bits = torch.full((width,), others, dtype=torch.int64)
        bits[special_positions] = special
        return bits

    gen = torch.Generator().manual_seed(num_chunks)
    low_bytes = 0x3FC00000 + torch.randperm(256, generator=gen)[:width]
    rows = [row(0x3FC00000, 0x40200000),  # 1.5 and 2.5: top bytes differ
            row(0x3FC00000, 0x3FE00000),  # 1.5 and 1.75: second bytes differ
            row(0x3FC00000, 0x3FC08000),  # third bytes differ
            row(0x3FC00000, 0x3FC00001),  # low bytes differ
            row(0x3FC00000, 0x3FC00000),  # all equal: ties to the lowest positions
            low_bytes, -low_bytes]
    logits = _floats(torch.stack(rows).tolist())
    want_digits, want_searching = [1, 2, 3, 3, 3, 3, 3], [0, 0, 0, 1, 1, 1, 1]
    assert torch.unique(float_order_key(logits[5]) >> 8).numel() == 1
    logits, seqlens, page_table = _inputs(logits, [width] * len(rows), width=width)
    workspace = _garbage_workspace(len(rows), num_chunks, device)
    out, positions = _run(logits, seqlens, page_table, k, device, workspace=workspace)
    assert torch.equal(positions.long(), reference_topk_positions(logits, seqlens, k))
    assert torch.equal(out, reference_topk_slots(logits, seqlens, page_table, k))
    state = workspace[:, 0, topk_module._STATE.value:].cpu()
    assert state[:, topk_module._LEVELS.value].tolist() == want_digits
    assert state[:, topk_module._SEARCHING.value].tolist() == want_searching


def test_chunked_reused_workspace_no_positions(device):
    """One workspace for calls with other lengths (as in graph replays), ``out`` only."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 300, generator=gen)
    workspace = _garbage_workspace(4, 3, device)
    for lengths in ([300, 10, 0, 41], [0, 299, 64, 128], [1, 2, 300, 300]):
        row_logits, seqlens, page_table = _inputs(logits, lengths, width=300)
        out = torch.zeros(4, 32, dtype=torch.int32, device=device)
        topk_slots(row_logits.to(device), seqlens.to(device), page_table.to(device), 32, out,
                   workspace=workspace, check_values=False)
        assert torch.equal(out.cpu(), reference_topk_slots(row_logits, seqlens, page_table, 32))


def _chunk_bounds(length, num_chunks):
    """The chunks' position ranges of a row (as the kernels cut it under the interpreter: chunks
    of cdiv(length, P) rounded up to 16, at least 16)."""
    size = max(-(-length // num_chunks), 16)
    size = -(-size // 16) * 16
    return [(start, min(start + size, length)) for start in range(0, length, size)]


@pytest.mark.parametrize("single_launch", [False, True])
@pytest.mark.parametrize("k, num_chunks", [(16, 1), (16, 3), (40, 5), (1, 2), (16, 8)])
def test_chunked_sampled_lists(monkeypatch, k, num_chunks, single_launch, device):
    """The chunked form with candidate lists: rows around the sampled form's shortest length for
    this chunk count (at 8 chunks set by the shortest chunk that lists) and longer, next to rows
    that copy or take the chunk passes over their range; exact, and each chunk's region holds its
    own positions that reached the bound, ascending, among them the chunk's share of the
    selection. The single launch runs under the interpreter too with one chunk per row (its
    barriers then pass on arrival: the waiting and the reads of other programs' lists and counts
    run only on the GPU, in test_gpu_single_launch_at_the_fit_limit)."""
    if single_launch and device.type != "cuda":
        if num_chunks > 1:
            pytest.skip("under the interpreter the single launch needs one program per row")
        monkeypatch.setattr(topk_module, "topk_single_launch_fits", lambda *args: True)
    shortest = topk_sampled_min_live(k, device, num_chunks)
    if num_chunks == 8 and device.type != "cuda":
        assert shortest > topk_sampled_min_live(k, device)  # the chunk length rule decides here
    lengths = [0, k, k + 1, shortest - 1, shortest, shortest + 1, 3 * shortest + 5]
    gen = torch.Generator().manual_seed(k + num_chunks)
    logits = torch.randn(len(lengths), max(lengths), generator=gen)
    logits[:, ::7] = torch.round(logits[:, ::7])  # ties
    logits, seqlens, page_table = _inputs(logits, lengths, width=max(lengths) + 3)
    candidates = _junk_candidates(len(lengths), k, device, num_chunks)
    positions = _assert_topk(logits, seqlens, page_table, k, device, num_chunks=num_chunks,
                             single_launch=single_launch or None, candidates=candidates)
    for row, length in enumerate(lengths):
        chosen = positions[row][positions[row] >= 0]
        listed = [_listed(candidates, row, num_chunks, chunk, logits)
                  for chunk in range(num_chunks)]
        if length < shortest:
            assert sum(entries.numel() for entries in listed) == 0, f"row {row} listed"
            continue
        assert sum(entries.numel() for entries in listed) >= k
        for chunk, (start, end) in enumerate(_chunk_bounds(length, num_chunks)):
            entries = listed[chunk]
            assert bool((entries[1:] > entries[:-1]).all())
            assert bool(((entries >= start) & (entries < end)).all())
            mine = chosen[(chosen >= start) & (chosen < end)]
            assert bool(torch.isin(mine, entries).all()), f"row {row} chunk {chunk}"


@pytest.mark.parametrize("num_chunks, single_launch", [(2, None), (3, None), (1, True)])
def test_chunked_sampled_falls_back(monkeypatch, num_chunks, single_launch, device):
    """Lists that cannot serve: every sampled position larger than the rest (fewer than k
    listed in all), equal logits (a chunk lists more than its region holds), and equal logits in
    the second half only (one chunk overflows, the first lists little): the chunk passes over the
    ranges then run, exact. In the single launch the lists kernel runs them (under the
    interpreter with one chunk a row, so no program waits for another there)."""
    if single_launch:
        monkeypatch.setattr(topk_module, "topk_single_launch_fits", lambda *args: True)
    k = 32
    stride = topk_module._sample_stride(device)
    length = topk_sampled_min_live(k, device, num_chunks) * 2
    gen = torch.Generator().manual_seed(num_chunks)
    logits = torch.randn(3, length, generator=gen)
    # distinct integers far above the rest: the bound's bin (16 bits) holds one sampled key
    logits[0, ::stride] = 100.0 + torch.arange(logits[0, ::stride].numel()).float()
    logits[1] = 0.75
    logits[2, length // 2:] = 9.0
    logits, seqlens, page_table = _inputs(logits, [length] * 3, width=length)
    candidates = _junk_candidates(3, k, device, num_chunks)
    _assert_topk(logits, seqlens, page_table, k, device, num_chunks=num_chunks,
                 candidates=candidates, single_launch=single_launch)
    capacity = candidates.shape[1] // num_chunks // 2
    assert 0 < sum(_listed(candidates, 0, num_chunks, c).numel() for c in range(num_chunks)) < k
    assert _listed(candidates, 1, num_chunks, 0).numel() == capacity  # filled up: overflowed
    assert _listed(candidates, 2, num_chunks, num_chunks - 1).numel() == capacity


def test_workspace_size():
    per_sm, fewest = topk_module.PROGRAMS_PER_SM, topk_module.MIN_CHUNKS
    assert topk_num_chunks(1, 132) == topk_module.MAX_CHUNKS
    assert topk_num_chunks(64, 132) == per_sm * 132 // 64
    assert topk_num_chunks(per_sm * 132 // fewest, 132) == fewest
    assert topk_num_chunks(per_sm * 132 // fewest + 1, 132) == 1  # too few chunks to pay off
    assert topk_workspace(per_sm * 132, "cpu", num_sms=132) is None
    # from num_sms // TOPK_LISTS_MAX_CHUNKS rows on, chunk counts that take candidate lists
    most = topk_module.TOPK_LISTS_MAX_CHUNKS
    assert topk_num_chunks(132 // most - 1, 132) == per_sm * 132 // (132 // most - 1) > most
    assert topk_num_chunks(132 // most, 132) == most
    workspace = topk_workspace(3, "cpu", num_sms=8)
    assert workspace.shape == (3, per_sm * 8 // 3, TOPK_WORKSPACE_WORDS)
    assert workspace.dtype == torch.int32
    assert topk_workspace(200, "cpu", num_chunks=1).shape == (200, 1, TOPK_WORKSPACE_WORDS)
    with pytest.raises(ValueError, match="num_chunks: expected >= 1, got 0"):
        topk_workspace(2, "cpu", num_chunks=0)


@pytest.mark.parametrize("call, error, message", [
    (lambda: topk_workspace(-1, "cpu", num_sms=8), ValueError, "num_rows: expected >= 1, got -1"),
    (lambda: topk_workspace(0, "cpu", num_chunks=2), ValueError, "num_rows: expected >= 1, got 0"),
    (lambda: topk_workspace(2.0, "cpu", num_chunks=2), TypeError, r"num_rows: expected an int, got 2.0 \(float\)"),
    (lambda: topk_workspace(2, "cpu", num_sms=0), ValueError, "num_sms: expected >= 1, got 0"),
    (lambda: topk_workspace(2, "cpu", num_chunks=2.5), TypeError, "num_chunks: expected an int, got 2.5"),
    (lambda: topk_candidates(-2, 4, "cpu"), ValueError, "num_rows: expected >= 1, got -2"),
    (lambda: topk_candidates(2, 4.0, "cpu"), TypeError, "k: expected an int, got 4.0"),
    (lambda: topk_candidates(2, 4, "cpu", num_chunks=True), TypeError, "num_chunks: expected an int, got True"),
])
def test_allocators_refuse_bad_sizes(call, error, message):
    """Negative, zero or non-int sizes name the argument instead of a torch error (or, for zero
    rows or zero SMs, an unusable workspace)."""
    with pytest.raises(error, match=message):
        call()


def test_single_launch_fit_rule(monkeypatch):
    """One cooperative launch only on a CUDA device and for at most SINGLE_LAUNCH_PROGRAMS_PER_SM
    programs per SM (so every program of a row can wait for the others); otherwise five launches."""
    monkeypatch.setattr(topk_module, "sm_count", lambda device: 132)
    monkeypatch.setattr(topk_module, "interpreted", lambda kernel: False)
    per_sm = topk_module.SINGLE_LAUNCH_PROGRAMS_PER_SM
    assert topk_module.topk_single_launch_fits(8, per_sm * 132 // 8, "cuda")
    assert topk_module.topk_single_launch_fits(per_sm * 132, 1, "cuda")
    assert not topk_module.topk_single_launch_fits(per_sm * 132 + 1, 1, "cuda")
    assert not topk_module.topk_single_launch_fits(2, per_sm * 66 + 1, "cuda")
    assert not topk_module.topk_single_launch_fits(1, 2, "cpu")
    # the default chunk count always fits
    for rows in (1, 3, 16, 64, 66, 67, 256):
        assert topk_module.topk_single_launch_fits(rows, topk_num_chunks(rows, 132), "cuda")


def test_single_launch_refused_under_the_interpreter(monkeypatch, device):
    """Under TRITON_INTERPRET=1 programs run one after another, so a program waiting at a barrier
    for its row's next program would wait forever: the fit rule says no even for CUDA tensors (the
    interpreter takes them on a CUDA machine), and single_launch=True is an error."""
    monkeypatch.setattr(topk_module, "sm_count", lambda device: 132)
    kernel = topk_module._topk_chunk_single_launch_kernel
    assert topk_module.interpreted(kernel) == (os.environ.get("TRITON_INTERPRET") == "1")
    monkeypatch.setattr(topk_module, "interpreted", lambda kernel: True)
    assert not topk_module.topk_single_launch_fits(1, 2, "cuda")
    logits, seqlens, page_table = _inputs(torch.randn(2, 100), [100, 60], width=100)
    with pytest.raises(ValueError, match=r"single_launch: needs a CUDA device, compiled kernels "
                                         r"\(not the Triton interpreter\)"):
        _run(logits, seqlens, page_table, 8, device, workspace=topk_workspace(2, device, 2),
             single_launch=True)


@pytest.mark.parametrize("with_lists", [False, True])
def test_refused_cooperative_grid_takes_five_launches(monkeypatch, device, with_lists):
    """A grid the driver refuses as one cooperative launch (fewer SMs usable than the device
    reports: MPS, a green context; here the launch raises as CUDA's refusal does): the default
    takes the five launches, exact, and later calls with as many programs do not try again (so
    a graph captured after the eager warm-up holds no refused launch); single_launch=True raises
    the refusal."""
    monkeypatch.setattr(topk_module, "topk_single_launch_fits", lambda *args: True)
    monkeypatch.setattr(topk_module, "_REFUSED_GRIDS", {})
    name = "_topk_chunk_lists_kernel" if with_lists else "_topk_chunk_single_launch_kernel"
    seen = []

    def refuse(*args, **kwargs):
        seen.append(kwargs.get("PASS", "single"))
        if "PASS" not in kwargs:
            raise RuntimeError("Triton Error [CUDA]: too many blocks in cooperative launch")

    for kernel in (topk_module._topk_chunk_pass_kernel, getattr(topk_module, name)):
        monkeypatch.setattr(kernel, "pre_run_hooks", [refuse])
    logits, seqlens, page_table = _inputs(torch.randn(2, 100), [100, 60], width=100)
    candidates = topk_candidates(2, 8, device, num_chunks=2) if with_lists else None
    passes = ([int(topk_module._LIST_PASS)] if with_lists else []) + list(range(5))
    _assert_topk(logits, seqlens, page_table, 8, device, num_chunks=2, candidates=candidates)
    assert seen == ["single"] + passes
    seen.clear()
    _assert_topk(logits, seqlens, page_table, 8, device, num_chunks=2, candidates=candidates)
    assert seen == passes
    with pytest.raises(RuntimeError, match="too many blocks in cooperative launch"):
        _assert_topk(logits, seqlens, page_table, 8, device, num_chunks=2, single_launch=True,
                     candidates=candidates)


def test_single_launch_counter_checked(monkeypatch, device):
    """check_values: a barrier counter not at zero on entry to the single launch (every program of
    the row would wait forever on the GPU) is an error naming the workspace and the row."""
    monkeypatch.setattr(topk_module, "topk_single_launch_fits", lambda *args: True)
    logits, seqlens, page_table = _inputs(torch.randn(3, 16), [16, 10, 3], width=16)
    workspace = _garbage_workspace(3, 2, device)
    workspace[1, 0, TOPK_COUNTER_WORDS] = 3
    with pytest.raises(ValueError, match=r"workspace: the barrier counter workspace\[1, 0, "
                                         r"TOPK_COUNTER_WORDS\] is 3, expected 0 on entry to the "
                                         r"single launch"):
        _run(logits, seqlens, page_table, 5, device, workspace=workspace, single_launch=True)
    # the five launches never read it
    out = torch.zeros(3, 5, dtype=torch.int32, device=device)
    topk_slots(logits.to(device), seqlens.to(device), page_table.to(device), 5, out,
               workspace=workspace, single_launch=False)
    assert torch.equal(out.cpu(), reference_topk_slots(logits, seqlens, page_table, 5))


@pytest.mark.parametrize("with_lists", [False, True])
@pytest.mark.parametrize("single_launch", [None, False])
def test_chunked_launches(monkeypatch, device, single_launch, with_lists):
    """The kernels a chunked call really launches (Triton pre-run hooks): by default one cooperative
    launch on the GPU (with candidate lists: of the lists kernel, which takes every row), five
    under the interpreter and with single_launch=False (with lists: the list pass first)."""
    seen = []
    for kernel in (topk_module._topk_chunk_pass_kernel, topk_module._topk_chunk_single_launch_kernel,
                   topk_module._topk_chunk_lists_kernel):
        monkeypatch.setattr(kernel, "pre_run_hooks",
                            [lambda *a, _name=kernel.__name__, **kw: seen.append((_name, kw.get("PASS")))])
    logits, seqlens, page_table = _inputs(torch.randn(2, 100), [100, 60], width=100)
    candidates = topk_candidates(2, 8, device, num_chunks=2) if with_lists else None
    _assert_topk(logits, seqlens, page_table, 8, device, num_chunks=2, single_launch=single_launch,
                 candidates=candidates)
    if device.type == "cuda" and single_launch is None:
        kernel = "_topk_chunk_lists_kernel" if with_lists else "_topk_chunk_single_launch_kernel"
        assert seen == [(kernel, None)]
    else:
        passes = ([int(topk_module._LIST_PASS)] if with_lists else []) + list(range(5))
        assert seen == [("_topk_chunk_pass_kernel", p) for p in passes]


def test_single_launch_with_one_program_per_row_runs_anywhere(monkeypatch, device):
    """The single-launch kernel itself, under the interpreter too: rows no longer than one chunk
    (16 positions there) have one active program, so every barrier is passed by arriving, and the
    interpreter's one-program-at-a-time order cannot wait forever. Copy rows, and searching rows
    whose k entries are alone in their bin of digit 0, 1 or 2 (the search stops after 1, 2 or 3
    digits) or share their top 24 bits (all four): checked through the search state the passes
    leave in the workspace (digits found by the last search pass, still searching), and the last
    barrier's reset of the counter (_run).

    On the CPU the barrier's waiting loop and the reads of other programs' histograms and state
    never run (one active program a row, and the interpreter runs one program at a time); the GPU
    tests with several programs a row do: test_gpu_single_launch_at_the_fit_limit (every program
    waits at every barrier), test_gpu_chunked_edge_lengths and test_gpu_chunked_production_sizes
    with single_launch=True."""
    monkeypatch.setattr(topk_module, "topk_single_launch_fits", lambda *args: True)
    seen = []
    monkeypatch.setattr(topk_module._topk_chunk_single_launch_kernel, "pre_run_hooks",
                        [lambda *a, **kw: seen.append("single")])
    k, width = 5, 16
    gen = torch.Generator().manual_seed(5)

    def row(length, others, special):
        bits = torch.full((width,), others, dtype=torch.int64)
        bits[torch.randperm(length, generator=gen)[:k]] = special
        return bits

    copies = [0, 1, 4, 5]
    searching = [(6, row(6, 0x3FC00000, 0x40200000)),  # 1.5 and 2.5: top bytes differ
                 (9, row(9, 0x3FC00000, 0x3FE00000)),  # second bytes differ
                 (12, row(12, 0x3FC00000, 0x3FC08000)),  # third bytes differ
                 (16, row(16, 0x3FC00000, 0x3FC00001)),  # low bytes differ
                 (16, row(16, 0x3FC00000, 0x3FC00000)),  # all ties
                 (16, 0x3FC00000 + torch.randint(0, 256, (width,), generator=gen))]
    want_digits, want_searching = [1, 2, 3, 3, 3, 3], [0, 0, 0, 1, 1, 1]
    lengths = copies + [length for length, _ in searching]
    logits = torch.cat([torch.randn(len(copies), width, generator=gen),
                        _floats(torch.stack([bits for _, bits in searching]).tolist())])
    logits, seqlens, page_table = _inputs(logits, lengths, width=20)
    workspace = _garbage_workspace(len(lengths), 3, device)
    out, positions = _run(logits, seqlens, page_table, k, device, workspace=workspace,
                          single_launch=True)
    assert torch.equal(positions.long(), reference_topk_positions(logits, seqlens, k))
    assert torch.equal(out, reference_topk_slots(logits, seqlens, page_table, k))
    assert seen == ["single"]
    state = workspace[len(copies):, 0, topk_module._STATE.value:].cpu()
    assert state[:, topk_module._LEVELS.value].tolist() == want_digits
    assert state[:, topk_module._SEARCHING.value].tolist() == want_searching


def test_decode_bench_attributes_every_topk_kernel():
    """Every kernel of this module (a jitted function nothing in dsaspec/ops/topk.py calls: what is
    launched), found in its source apart from the bench's own lookup, lands in the benches' topk
    phase (dsaspec/bench/phases.py), so a kernel added here cannot be missed there."""
    from dsaspec.bench import phases

    tree = ast.parse(inspect.getsource(topk_module))
    jitted = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)
              and any("jit" in ast.unparse(decorator) for decorator in node.decorator_list)}
    called = {node.func.id for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    kernels = jitted - called
    assert {"_topk_slots_kernel", "_topk_chunk_lists_kernel"} <= kernels
    assert {name: phases._phase_by_name(name) for name in kernels} == dict.fromkeys(kernels, "topk")


def test_bad_workspace(device):
    logits = torch.zeros(2, 32, device=device)
    seqlens = torch.tensor([3, 20], dtype=torch.int32, device=device)
    table = torch.zeros(2, 32, dtype=torch.int32, device=device)
    out = torch.zeros(2, 4, dtype=torch.int32, device=device)
    words = TOPK_WORKSPACE_WORDS

    def call(workspace, **kwargs):
        topk_slots(logits, seqlens, table, 4, out, workspace=workspace, **kwargs)

    with pytest.raises(ValueError, match="workspace: expected dtype torch.int32, got torch.int64"):
        call(torch.zeros(2, 3, words, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match=rf"workspace: expected shape \(2, '\*', {words}\), got "
                                         rf"\(3, 3, {words}\)"):
        call(torch.zeros(3, 3, words, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=rf"workspace: expected shape \(2, '\*', {words}\)"):
        call(torch.zeros(2, 3, 1024, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="workspace: expected 3 dimensions"):
        call(torch.zeros(2, 3 * words, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="workspace: expected device"):
        call(torch.zeros(2, 3, words, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match=r"workspace: expected a contiguous \[R, P, "):
        call(torch.zeros(3, 2, words, dtype=torch.int32, device=device).transpose(0, 1))
    with pytest.raises(ValueError, match=r"workspace: expected a contiguous \[R, P, .*1 <= P"):
        call(torch.zeros(2, 0, words, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="baseline_read_short_rows: only without a workspace"):
        call(torch.zeros(2, 3, words, dtype=torch.int32, device=device), baseline_read_short_rows=True)
    with pytest.raises(ValueError, match="single_launch: only with a workspace"):
        call(None, single_launch=False)
    # 2 x 1000 programs are more than 4 per SM of any device this runs on (and the CPU has none)
    with pytest.raises(ValueError, match=r"single_launch: needs a CUDA device, compiled kernels "
                                         r"\(not the Triton interpreter\) and at most 4 programs "
                                         r"per SM, got 2 rows x 1000 chunks on "):
        call(torch.zeros(2, 1000, words, dtype=torch.int32, device=device), single_launch=True)


GPU_WIDTH = 1_048_586


def _production_inputs(num_rows, longest):
    """Rows up to ``longest`` live in a 1M-wide buffer (the first row that long; with 2 rows or
    more the last exactly k = 2048); plenty of ties; with 4 rows or more, rows 1 and 2 ``longest``
    long, one all equal, one with keys that differ only in the low byte (all four digits)."""
    gen = torch.Generator().manual_seed(num_rows)
    seqlens = torch.randint(0, longest + 1, (num_rows,), generator=gen)
    if num_rows > 1:
        seqlens[-1] = 2048
    seqlens[0] = longest
    logits = torch.randn(num_rows, longest, generator=gen)
    logits[:, ::7] = torch.round(logits[:, ::7])
    if num_rows >= 4:
        seqlens[1:3] = longest
        logits[1] = 0.5
        low_bytes = torch.randint(0, 256, (longest,), generator=gen, dtype=torch.int32)
        logits[2] = (torch.tensor(1.5).view(torch.int32) + low_bytes).view(torch.float32)
    seqlens = seqlens.tolist()
    wide = torch.empty(num_rows, GPU_WIDTH)
    wide[:, :logits.shape[1]] = logits
    return _inputs(wide, seqlens, width=GPU_WIDTH, num_slots=1 << 24)


@pytest.mark.gpu
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("num_rows, longest", [(1, 65_536), (16, 8_192), (96, 65_536), (160, 20_000)])
def test_gpu_production_sizes(num_rows, longest, sampled):
    """One program per row, with candidate lists (``sampled``) or the whole-row passes; 160 rows
    (more than the SMs) run the lists capped at 128 registers a thread."""
    device = torch.device("cuda")
    _assert_topk(*_production_inputs(num_rows, longest), 2048, device,
                 candidates=_junk_candidates(num_rows, 2048, device) if sampled else None)


@pytest.mark.gpu
def test_gpu_sampled_lists_and_fallbacks():
    """k = 2048 on the GPU (every 32nd position sampled): rows just at and below the sampled
    form's shortest length, one whose sample misleads (too few candidates), one of equal logits
    (too many) and one of random logits much longer: exact, and the lists hold what they should."""
    device, k = torch.device("cuda"), 2048
    shortest = topk_sampled_min_live(k, device)
    lengths = [shortest - 1, shortest, shortest + 5, shortest + 5, 200_003]
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(len(lengths), max(lengths), generator=gen)
    sampled = logits[2, ::topk_module._sample_stride(device)]
    logits[2, ::topk_module._sample_stride(device)] = 100.0 + torch.arange(sampled.numel()).float()
    logits[3] = -2.5
    logits, seqlens, page_table = _inputs(logits, lengths, width=max(lengths), num_slots=1 << 20)
    candidates = _junk_candidates(len(lengths), k, device)
    positions = _assert_topk(logits, seqlens, page_table, k, device, candidates=candidates)
    assert _listed(candidates, 0).numel() == 0
    assert 0 < _listed(candidates, 2).numel() < k
    assert _listed(candidates, 3).numel() == candidates.shape[1] // 2
    for row in (1, 4):
        listed = _listed(candidates, row, logits=logits)
        assert k <= listed.numel() < candidates.shape[1] // 2
        assert bool(torch.isin(positions[row], listed).all())


@pytest.mark.gpu
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("single_launch", [True, False])
@pytest.mark.parametrize("num_rows, longest, num_chunks", [
    (1, 65_536, None), (4, 8_192, None), (16, 65_536, None), (32, 65_536, None),
    (64, 65_536, None), (64, 65_536, 64), (4, 1_000_000, None)])
def test_gpu_chunked_production_sizes(num_rows, longest, num_chunks, single_launch, sampled):
    """The chunked form at real sizes, in one launch and in five, with candidate lists per chunk
    (``sampled``; rows of equal logits overflow them and fall back) or without: the chunk count
    topk_workspace picks for the device (and 64 chunks for 64 rows, too many programs for one
    launch)."""
    device = torch.device("cuda")
    workspace = topk_workspace(num_rows, device, num_chunks=num_chunks)
    assert workspace is not None
    if single_launch and not topk_module.topk_single_launch_fits(num_rows, workspace.shape[1], device):
        pytest.skip(f"{num_rows} x {workspace.shape[1]} programs do not fit one cooperative launch")
    if sampled and workspace.shape[1] > topk_module.TOPK_LISTS_MAX_CHUNKS:
        pytest.skip(f"no candidate lists for {workspace.shape[1]} chunks a row")
    candidates = (_junk_candidates(num_rows, 2048, device, workspace.shape[1]) if sampled
                  else None)
    logits, seqlens, page_table = _production_inputs(num_rows, longest)
    out, positions = _run(logits, seqlens, page_table, 2048, device, workspace=workspace,
                          single_launch=single_launch, candidates=candidates)
    assert torch.equal(positions.long(), reference_topk_positions(logits, seqlens, 2048))
    assert torch.equal(out, reference_topk_slots(logits, seqlens, page_table, 2048))


@pytest.mark.gpu
@pytest.mark.parametrize("with_lists", [False, True])
def test_gpu_single_launch_at_the_fit_limit(with_lists):
    """A single launch of SINGLE_LAUNCH_PROGRAMS_PER_SM programs per SM (every row long enough to
    use all its chunks, so every program waits at every barrier; with candidate lists, of the
    lists kernel at its register cap, every row long enough to list): all resident at once,
    exact, and the listing rows' lists hold their selection."""
    device, k = torch.device("cuda"), 2048
    programs = topk_module.SINGLE_LAUNCH_PROGRAMS_PER_SM * torch.cuda.get_device_properties(
        device).multi_processor_count
    if with_lists:
        num_chunks = topk_module.TOPK_LISTS_MAX_CHUNKS
        num_rows = programs // num_chunks
        longest = topk_sampled_min_live(k, device, num_chunks) + 100
    else:
        num_rows = 8
        num_chunks = programs // num_rows
        longest = num_chunks * 1024
    gen = torch.Generator().manual_seed(num_chunks)
    logits = torch.randn(num_rows, longest, generator=gen)
    if not with_lists:
        logits[:, ::3] = 0.25  # ties at the k-th value
    logits, seqlens, page_table = _inputs(logits, [longest] * num_rows, width=longest,
                                          num_slots=1 << 22)
    candidates = _junk_candidates(num_rows, k, device, num_chunks) if with_lists else None
    positions = _assert_topk(logits, seqlens, page_table, k, device, num_chunks=num_chunks,
                             single_launch=True, candidates=candidates)
    if with_lists:
        for row in range(num_rows):
            listed = torch.cat([_listed(candidates, row, num_chunks, chunk, logits)
                                for chunk in range(num_chunks)])
            assert bool(torch.isin(positions[row].cpu(), listed).all()), f"row {row}"


@pytest.mark.gpu
@pytest.mark.parametrize("with_lists", [False, True])
def test_gpu_refused_cooperative_grid_takes_five_launches(monkeypatch, with_lists):
    """The driver's own refusal: 17 programs per SM (more than its 2048 threads hold in programs
    of 128) past a fit rule told to say yes. The default falls back to the five launches, exact
    (the refusal leaves no error behind) and remembered; single_launch=True raises it."""
    device, k = torch.device("cuda"), 2048
    monkeypatch.setattr(topk_module, "topk_single_launch_fits", lambda *args: True)
    monkeypatch.setattr(topk_module, "_REFUSED_GRIDS", {})
    num_rows = 2
    num_chunks = -(-17 * torch.cuda.get_device_properties(device).multi_processor_count
                   // num_rows)
    lengths = [300_000, 5_000]
    gen = torch.Generator().manual_seed(17)
    logits, seqlens, page_table = _inputs(torch.randn(num_rows, 300_000, generator=gen), lengths,
                                          width=300_000, num_slots=1 << 20)
    candidates = None
    if with_lists:  # a list region per chunk (topk_candidates allocates none for this many)
        candidates = torch.full((num_rows, num_chunks * topk_candidates_width(k, device)), JUNK,
                                dtype=torch.int32, device=device)
    _assert_topk(logits, seqlens, page_table, k, device, num_chunks=num_chunks,
                 candidates=candidates)
    name = "_topk_chunk_lists_kernel" if with_lists else "_topk_chunk_single_launch_kernel"
    assert topk_module._REFUSED_GRIDS == {(name, device.index or 0): num_rows * num_chunks}
    with pytest.raises(RuntimeError, match="too many blocks in cooperative launch"):
        _assert_topk(logits, seqlens, page_table, k, device, num_chunks=num_chunks,
                     single_launch=True, candidates=candidates)


@pytest.mark.gpu
@pytest.mark.parametrize("single_launch", [True, False])
@pytest.mark.parametrize("num_chunks", [None, 1, 2, 3, 5])
def test_gpu_chunked_edge_lengths(num_chunks, single_launch):
    """Both chunked launch forms on the GPU at edge lengths around k and around the 1024-long
    chunks (one row per length, so chunk counts 1..P occur), the counter zero after each."""
    k = 2048
    lengths = [0, 1, 63, 64, 65, 127, 128, 129, 1023, 1024, 1025, k - 1, k, k + 1, 3000, 4097,
               5 * 1024 + 1, 9000]
    gen = torch.Generator().manual_seed(len(lengths))
    logits = torch.randn(len(lengths), 9000, generator=gen)
    logits[::2, ::5] = 0.25  # ties
    logits, seqlens, page_table = _inputs(logits, lengths, width=9100, num_slots=1 << 20)
    _assert_topk(logits, seqlens, page_table, k, torch.device("cuda"),
                 num_chunks=num_chunks or topk_num_chunks(len(lengths), 132),
                 single_launch=single_launch)


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows, chunked", [(32, False), (32, "sampled"), (32, True), (2, True),
                                               (2, "five"), (33, "lists"), (64, "five_lists")])
def test_gpu_cuda_graph_replay_with_new_lengths(num_rows, chunked):
    device = torch.device("cuda")
    width, k = 70_000, 2048
    gen = torch.Generator().manual_seed(0)
    logits, _, page_table = _inputs(torch.randn(num_rows, width, generator=gen), [width] * num_rows,
                                    width=width)
    logits_d, table_d = logits.to(device), page_table.to(device)
    seqlens_d = torch.ones(num_rows, dtype=torch.int32, device=device)
    out = torch.zeros(num_rows, k, dtype=torch.int32, device=device)
    positions = torch.zeros_like(out)
    # one program per row (False, or "sampled": with candidate lists), or chunked: one
    # cooperative launch (True, the default where it fits; "lists": with candidate lists) or
    # "five" launches ("five_lists": six, the lists first)
    chunked_forms = (True, "five", "lists", "five_lists")
    workspace = topk_workspace(num_rows, device) if chunked in chunked_forms else None
    assert (chunked in chunked_forms) == (workspace is not None)
    candidates = None
    if chunked in ("sampled", "lists", "five_lists"):
        candidates = topk_candidates(num_rows, k, device,
                                     num_chunks=1 if workspace is None else workspace.shape[1])
        assert candidates is not None
    single_launch = None if workspace is None else chunked in (True, "lists")
    topk_slots(logits_d, seqlens_d, table_d, k, out, out_positions=positions, workspace=workspace,
               single_launch=single_launch, candidates=candidates)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk_slots(logits_d, seqlens_d, table_d, k, out, check_values=False,
                   out_positions=positions, workspace=workspace, single_launch=single_launch,
                   candidates=candidates)
    for high in (3, 2_048, 3_000, 20_000, width):
        seqlens = torch.randint(0, high + 1, (num_rows,), generator=gen, dtype=torch.int32)
        seqlens_d.copy_(seqlens)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(positions.cpu().long(), reference_topk_positions(logits, seqlens, k))
        assert torch.equal(out.cpu(), reference_topk_slots(logits, seqlens, page_table, k))
    if workspace is not None:
        assert not workspace[:, 0, TOPK_COUNTER_WORDS].any()
