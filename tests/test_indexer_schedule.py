"""indexer_schedule against its reference: exact equality, every scheduled block owned exactly once,
rows no longer than skip_len never scheduled."""

import pytest
import torch

from dsaspec.ops.indexer_schedule import indexer_schedule
from dsaspec.reference.indexer_schedule import reference_indexer_schedule, schedule_shares

EDGE_LENGTHS = [0, 1, 63, 64, 65, 127, 128, 129, 2047, 2048, 2049]


def _run(seqlens, num_sms, device, skip_len=0, rows_per_group=1):
    out = torch.full((num_sms + 1, 2), -7, dtype=torch.int32, device=device)
    indexer_schedule(seqlens.to(device), num_sms, out, skip_len=skip_len,
                     rows_per_group=rows_per_group)
    return out.cpu()


def _check(seqlens, num_sms, device, skip_len=0, rows_per_group=1):
    seqlens = torch.as_tensor(seqlens, dtype=torch.int32)
    got = _run(seqlens, num_sms, device, skip_len, rows_per_group)
    want = reference_indexer_schedule(seqlens, num_sms, skip_len=skip_len,
                                      rows_per_group=rows_per_group)
    assert torch.equal(got, want), (seqlens, num_sms, skip_len, rows_per_group)
    shares = schedule_shares(got, seqlens, skip_len=skip_len, rows_per_group=rows_per_group)
    owned = [pair for share in shares for pair in share]
    # stated here independently of the reference: every block up to the longest row longer
    # than skip_len of each group
    lengths = seqlens.tolist()
    live = []
    for unit in range(len(lengths) // rows_per_group):
        members = lengths[unit * rows_per_group:(unit + 1) * rows_per_group]
        longest = max([length for length in members if length > skip_len], default=0)
        live += [(unit, block) for block in range(-(-longest // 64))]
    assert owned == live
    sizes = [len(share) for share in shares]
    assert max(sizes) - min(sizes) <= 1
    assert got[-1].tolist() == [seqlens.numel() // rows_per_group, 0]


@pytest.mark.parametrize("length", EDGE_LENGTHS)
@pytest.mark.parametrize("num_sms", [1, 3, 8])
def test_single_row_edges(length, num_sms, device):
    _check([length], num_sms, device)


@pytest.mark.parametrize("num_sms", [1, 2, 5, 16, 132])
def test_edge_lengths_many_rows(num_sms, device):
    _check(EDGE_LENGTHS + [3, 0, 70, 0], num_sms, device)


def test_all_zero_and_empty(device):
    _check([0] * 7, 4, device)
    _check([], 3, device)


def test_negative_lengths_count_as_zero(device):
    _check([-5, 64, -1, 65], 3, device)


@pytest.mark.parametrize("seed", range(4))
def test_random_many_rows(seed, device):
    gen = torch.Generator().manual_seed(seed)
    rows = [1, 7, 96, 300][seed]
    lengths = torch.randint(0, 5000, (rows,), generator=gen)
    lengths[torch.rand(rows, generator=gen) < 0.2] = 0
    _check(lengths, [132, 5, 64, 132][seed], device)


def test_more_sms_than_blocks(device):
    _check([1, 0, 65], 132, device)


@pytest.mark.parametrize("skip_len", [1, 64, 128, 2048])
@pytest.mark.parametrize("num_sms", [1, 3, 16])
def test_skip_short_rows(skip_len, num_sms, device):
    """Rows with length <= skip_len (sparse == dense) get no blocks, wherever they sit."""
    lengths = [skip_len, skip_len + 1, 0, skip_len - 1, 5000, skip_len, 1, 2 * skip_len + 3]
    _check(lengths, num_sms, device, skip_len=skip_len)


def test_skip_everything(device):
    """Every row short: nothing is scheduled, every SM starts (and ends) at (R, 0)."""
    got = _run(torch.tensor([3, 2048, 0, 100], dtype=torch.int32), 5, device, skip_len=2048)
    assert got.tolist() == [[4, 0]] * 6


@pytest.mark.parametrize("rows_per_group", [2, 3, 4, 6])
@pytest.mark.parametrize("skip_len", [0, 64])
def test_row_groups(rows_per_group, skip_len, device):
    """Groups of rows (target verify: the N rows of a request) are scheduled as one unit over
    their longest member longer than skip_len."""
    gen = torch.Generator().manual_seed(rows_per_group)
    lengths = torch.randint(0, 300, (rows_per_group * 9,), generator=gen)
    lengths[:rows_per_group] = 0  # an empty group
    lengths[rows_per_group:2 * rows_per_group] = skip_len  # a skipped group
    lengths[2 * rows_per_group] = skip_len + 1  # one long member
    for num_sms in (1, 5, 132):
        _check(lengths, num_sms, device, skip_len=skip_len, rows_per_group=rows_per_group)


@pytest.mark.parametrize("seed", range(2))
def test_skip_random_rows(seed, device):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4000, (77,), generator=gen)
    _check(lengths, 132, device, skip_len=2048)


def test_bad_arguments(device):
    seqlens = torch.ones(3, dtype=torch.int32, device=device)
    out = torch.zeros(5, 2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"out: expected shape \(5, 2\), got \(4, 2\)"):
        indexer_schedule(seqlens, 4, torch.zeros(4, 2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="seqlens: expected dtype torch.int32, got torch.int64"):
        indexer_schedule(seqlens.long(), 4, out)
    with pytest.raises(ValueError, match="num_sms: expected >= 1, got 0"):
        indexer_schedule(seqlens, 0, torch.zeros(1, 2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="block_kv: expected >= 1, got 0"):
        indexer_schedule(seqlens, 4, out, block_kv=0)
    with pytest.raises(ValueError, match="skip_len: expected >= 0, got -1"):
        indexer_schedule(seqlens, 4, out, skip_len=-1)
    with pytest.raises(ValueError, match="rows_per_group: expected a divisor >= 1 of the 3 rows, "
                                         "got 2"):
        indexer_schedule(seqlens, 4, out, rows_per_group=2)
    with pytest.raises(ValueError, match="rows_per_group: expected a divisor >= 1 of the 3 rows, "
                                         "got 0"):
        indexer_schedule(seqlens, 4, out, rows_per_group=0)
    with pytest.raises(ValueError, match="out: expected a contiguous"):
        indexer_schedule(seqlens, 4, torch.zeros(5, 4, dtype=torch.int32, device=device)[:, :2])


@pytest.mark.gpu
def test_cuda_graph_replay_with_new_lengths():
    device = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    seqlens = torch.ones(96, dtype=torch.int32, device=device)
    out = torch.zeros(num_sms + 1, 2, dtype=torch.int32, device=device)
    indexer_schedule(seqlens, num_sms, out)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        indexer_schedule(seqlens, num_sms, out)
    gen = torch.Generator().manual_seed(0)
    for high in (2, 100, 70_000):
        lengths = torch.randint(0, high, (96,), generator=gen, dtype=torch.int32)
        seqlens.copy_(lengths)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), reference_indexer_schedule(lengths, num_sms))


@pytest.mark.gpu
def test_cuda_graph_replay_skip_len():
    """The skip is decided on the device at every replay: lengths around the top-k change which
    rows are scheduled without recapture."""
    device = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    seqlens = torch.ones(256, dtype=torch.int32, device=device)
    out = torch.zeros(num_sms + 1, 2, dtype=torch.int32, device=device)
    indexer_schedule(seqlens, num_sms, out, skip_len=2048)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        indexer_schedule(seqlens, num_sms, out, skip_len=2048)
    gen = torch.Generator().manual_seed(1)
    for low, high in ((0, 2049), (2000, 2100), (0, 70_000)):
        lengths = torch.randint(low, high, (256,), generator=gen, dtype=torch.int32)
        seqlens.copy_(lengths)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), reference_indexer_schedule(lengths, num_sms, skip_len=2048))
