"""topk_slots: exact against the stable-sort reference, and a top-k set by torch.topk's standard;
rows with live <= k take every live position without reading logits."""

import pytest
import torch

from dsa_inputs import POISON_SLOT
from dsaspec.ops.topk import topk_slots
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


def _run(logits, seqlens, page_table, k, device, check_values=True, read_short_rows=False):
    out = torch.full((logits.shape[0], k), -7, dtype=torch.int32, device=device)
    positions = torch.full_like(out, -7)
    topk_slots(logits.to(device), seqlens.to(device), page_table.to(device), k, out,
               check_values=check_values, out_positions=positions,
               read_short_rows=read_short_rows)
    return out.cpu(), positions.cpu()


def _assert_topk(logits, seqlens, page_table, k, device, read_short_rows=False):
    out, positions = _run(logits, seqlens, page_table, k, device,
                          read_short_rows=read_short_rows)
    want_positions = reference_topk_positions(logits, seqlens, k)
    assert torch.equal(positions.long(), want_positions)
    assert torch.equal(out, reference_topk_slots(logits, seqlens, page_table, k))
    _assert_topk_set(logits, seqlens, positions, k)


def _assert_topk_set(logits, seqlens, positions, k):
    """By torch.topk's standard, allowing any choice among values tied at the k-th."""
    for row, length in enumerate(seqlens.tolist()):
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


@pytest.mark.parametrize("read_short_rows", [False, True])
@pytest.mark.parametrize("k", [1, 64, 100])
def test_edge_lengths_random_logits(k, read_short_rows, device):
    seqlens = EDGE_LENGTHS + [k - 1, k, k + 1, 300, 5]
    gen = torch.Generator().manual_seed(k)
    logits, seqlens, page_table = _inputs(torch.randn(len(seqlens), 320, generator=gen), seqlens,
                                          width=310, seed=k)
    _assert_topk(logits, seqlens, page_table, k, device, read_short_rows=read_short_rows)


@pytest.mark.parametrize("k", [64, 130])
def test_short_rows_ignore_logits(k, device):
    """Rows with live <= k (the indexer skips them, so their logits are whatever the buffer
    held: NaN here) take every live position in order; longer rows are unaffected."""
    seqlens = [0, 1, 63, 64, 65, 129, 130, 131, 300, k]
    gen = torch.Generator().manual_seed(k)
    logits, seqlens, page_table = _inputs(torch.randn(len(seqlens), 320, generator=gen),
                                          seqlens, width=300, seed=k)
    fresh = logits.clone()
    short = seqlens <= k
    fresh[short] = float("nan")
    out, positions = _run(fresh, seqlens, page_table, k, device)
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


GPU_WIDTH = 1_048_586


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows, longest", [(1, 65_536), (16, 8_192), (96, 65_536)])
def test_gpu_production_sizes(num_rows, longest):
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(num_rows)
    seqlens = torch.randint(0, longest + 1, (num_rows,), generator=gen)
    seqlens[0] = longest
    seqlens[-1] = 2048
    seqlens = seqlens.tolist()
    logits = torch.randn(num_rows, max(seqlens), generator=gen)
    logits[:, ::7] = torch.round(logits[:, ::7])  # plenty of ties
    wide = torch.empty(num_rows, GPU_WIDTH)
    wide[:, :logits.shape[1]] = logits
    wide, seqlens, page_table = _inputs(wide, seqlens, width=GPU_WIDTH, num_slots=1 << 24)
    _assert_topk(wide, seqlens, page_table, 2048, device)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_lengths():
    device = torch.device("cuda")
    num_rows, width, k = 32, 70_000, 2048
    gen = torch.Generator().manual_seed(0)
    logits, _, page_table = _inputs(torch.randn(num_rows, width, generator=gen), [width] * num_rows,
                                    width=width)
    logits_d, table_d = logits.to(device), page_table.to(device)
    seqlens_d = torch.ones(num_rows, dtype=torch.int32, device=device)
    out = torch.zeros(num_rows, k, dtype=torch.int32, device=device)
    positions = torch.zeros_like(out)
    topk_slots(logits_d, seqlens_d, table_d, k, out, out_positions=positions)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk_slots(logits_d, seqlens_d, table_d, k, out, check_values=False,
                   out_positions=positions)
    for high in (3, 2_048, 3_000, width):
        seqlens = torch.randint(0, high + 1, (num_rows,), generator=gen, dtype=torch.int32)
        seqlens_d.copy_(seqlens)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(positions.cpu().long(), reference_topk_positions(logits, seqlens, k))
        assert torch.equal(out.cpu(), reference_topk_slots(logits, seqlens, page_table, k))
