"""Live-bounded replay metadata against the plain-torch oracle and the context-wide kernel:
writing exactly the tile-rounded live prefix, bit-identical to both on every cell of it (the rest of
each row keeps its poison), and nothing outside the buffers; tuning knobs change nothing written."""

import pytest
import torch

from dsaspec.ops.baseline.dsa_metadata import context_wide_metadata
from dsaspec.ops.dsa_metadata import MAX_SPLITS, bounded_metadata, num_splits
from dsaspec.ops.dsa_metadata_common import MetadataBuffers
from dsaspec.forward_mode import Mode
from dsaspec.reference.dsa_metadata import assert_contract_equal, assert_written_equal, reference_metadata
from metadata_cases import assert_writes_exactly, make_batch, make_table, poisoned_buffers, poisoned_table

CASES = [
    (Mode.DECODE, 1, False),
    (Mode.TARGET_VERIFY, 5, False),
    (Mode.DRAFT_EXTEND, 6, False),
    (Mode.DRAFT_EXTEND, 5, True),
]


def _bounded(mode, table, idx, seq_lens, ext, n, page_size, budget, *, dests=1, topk=64, **knobs):
    """Reference and ``dests`` poisoned buffer sets written by one bounded call."""
    ref = reference_metadata(mode, table, idx, seq_lens, index_topk=topk, page_size=page_size,
                             num_draft_tokens=n, extend_seq_lens=ext)
    alloc = knobs.pop("alloc", {})
    made = [poisoned_buffers(mode, seq_lens.shape[0], table.shape[1], page_size, table.device,
                             num_draft_tokens=n, rows=ref.rows, **alloc) for _ in range(dests)]
    gots = [g for g, _ in made]
    bounded_metadata(mode, table, idx, seq_lens, gots if dests > 1 else gots[0], index_topk=topk,
                     page_size=page_size, num_draft_tokens=n, extend_seq_lens=ext, budget=budget, **knobs)
    assert all(a.outside_untouched() for _, arenas in made for a in arenas), "wrote outside the buffers"
    return ref, gots


@pytest.mark.parametrize("mode,n,variable", CASES)
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("width,batch,budget,dtype", [(450, 13, 40, torch.int32), (129, 3, 1, torch.int64),
                                                     (200, 16, 3, torch.int32)])
def test_bounded_matches_reference(device, mode, n, variable, page_size, width, batch, budget, dtype):
    table = poisoned_table(7, width, device, seed=width)
    idx, seq_lens, ext = make_batch(mode, batch, width, 7, n, device, seed=batch, dtype=dtype,
                                    variable=variable)
    ref, (got,) = _bounded(mode, table, idx, seq_lens, ext, n, page_size, budget)
    assert_writes_exactly(got, ref, mode, seq_lens, n, ext)


@pytest.mark.parametrize("mode,n,variable", CASES)
def test_bounded_matches_context_wide(device, mode, n, variable):
    """Both kernels write the same cells with the same values: from identically poisoned buffers
    they leave identical buffers."""
    table = make_table(7, 333, device, seed=2)
    idx, seq_lens, ext = make_batch(mode, 9, 333, 7, n, device, seed=5, variable=variable)
    _, (got,) = _bounded(mode, table, idx, seq_lens, ext, n, 64, 20)
    want, _ = poisoned_buffers(mode, 9, 333, 64, device, num_draft_tokens=n, rows=got.rows)
    context_wide_metadata(mode, table, idx, seq_lens, want, index_topk=64, page_size=64, num_draft_tokens=n,
                          extend_seq_lens=ext)
    for a, b in zip(got.tensors(), want.tensors()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dests", [2, 4, 5])
@pytest.mark.parametrize("mode,n,variable", [(Mode.DECODE, 1, False), (Mode.DRAFT_EXTEND, 3, True)])
def test_several_destinations_in_one_call(device, dests, mode, n, variable):
    table = make_table(5, 333, device)
    idx, seq_lens, ext = make_batch(mode, 6, 333, 5, n, device, variable=variable)
    ref, gots = _bounded(mode, table, idx, seq_lens, ext, n, 64, 9, dests=dests)
    for got in gots:
        assert_writes_exactly(got, ref, mode, seq_lens, n, ext)


def test_replay_with_new_lengths_rewrites_live_prefix(device):
    """Longer then shorter lengths into the same buffers: the live prefix is always current."""
    mode, n, W = Mode.TARGET_VERIFY, 3, 400
    out = MetadataBuffers.allocate(mode, 4, W, 64, device, num_draft_tokens=n)
    ptrs = [t.data_ptr() for t in out.tensors()]
    idx = torch.tensor([5, 2, 2, 0], device=device)
    for lengths in ([10, 1, 300, 64], [397, 129, 0, 1], [5, 5, 5, 5]):
        seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
        table = make_table(6, W, device, seed=sum(lengths))
        bounded_metadata(mode, table, idx, seq_lens, out, index_topk=16, page_size=64, num_draft_tokens=n, budget=6)
        want = reference_metadata(mode, table, idx, seq_lens, index_topk=16, page_size=64, num_draft_tokens=n)
        assert_contract_equal(out, want, mode, seq_lens, n)
    assert [t.data_ptr() for t in out.tensors()] == ptrs


def test_num_splits_bounds_the_grid():
    """Programs per request stay in [1, 256] and the copy programs of a launch within the budget
    (or one per request when the budget is smaller than the batch)."""
    for batch in (1, 2, 3, 16, 64, 255, 256, 257, 4096):
        for budget in (1, 7, 100, 2048, 10**6):
            splits = num_splits(batch, budget)
            assert 1 <= splits <= MAX_SPLITS
            assert batch * splits <= max(budget, batch)
            assert splits == MAX_SPLITS or batch * (splits + 1) > budget  # no budget left unused


@pytest.mark.parametrize("block_cols,num_warps,row_align", [(128, 4, 1), (256, 2, 1), (512, 4, 4), (128, 1, 16)])
def test_knobs_do_not_change_what_is_written(device, block_cols, num_warps, row_align):
    mode, n = Mode.TARGET_VERIFY, 2
    table = poisoned_table(4, 600, device)
    idx, seq_lens, _ = make_batch(mode, 5, 600, 4, n, device)
    ref, (got,) = _bounded(mode, table, idx, seq_lens, None, n, 64, 10, block_cols=block_cols,
                           num_warps=num_warps, alloc=dict(row_align=row_align))
    assert_writes_exactly(got, ref, mode, seq_lens, n)


def test_bad_knobs_and_mismatched_destinations(device):
    table = make_table(2, 128, device)
    idx = torch.tensor([0], device=device)
    s = torch.tensor([5], dtype=torch.int32, device=device)
    out = MetadataBuffers.allocate(Mode.DECODE, 1, 128, 64, device)
    with pytest.raises(ValueError, match="^budget must be >= 1, got 0$"):
        bounded_metadata(Mode.DECODE, table, idx, s, out, index_topk=8, page_size=64, budget=0)
    with pytest.raises(ValueError, match="^block_cols must be a power of two >= 128, got 96$"):
        bounded_metadata(Mode.DECODE, table, idx, s, out, index_topk=8, page_size=64, block_cols=96)
    with pytest.raises(ValueError, match="^num_warps must be a power of two >= 1, got 3$"):
        bounded_metadata(Mode.DECODE, table, idx, s, out, index_topk=8, page_size=64, num_warps=3)
    other = MetadataBuffers.allocate(Mode.DECODE, 1, 256, 64, device)
    with pytest.raises(ValueError, match=r"^out\[1\] does not match out\[0\] \(mode, page size, shapes, strides, device\)$"):
        bounded_metadata(Mode.DECODE, table, idx, s, [out, other], index_topk=8, page_size=64)
    with pytest.raises(ValueError, match="^extend_seq_lens is only for draft extend, not decode$"):
        bounded_metadata(Mode.DECODE, table, idx, s, out, index_topk=8, page_size=64, extend_seq_lens=s)
    with pytest.raises(ValueError, match="^out: at least one MetadataBuffers is required$"):
        bounded_metadata(Mode.DECODE, table, idx, s, [], index_topk=8, page_size=64)


# ---------------------------------------------------------------- GPU: full width, graphs, int64

FULL_W = 1_048_576 + 4 + 6  # 1M context with EAGLE 5/1/6


@pytest.mark.gpu
@pytest.mark.parametrize("mode,n,variable", CASES)
@pytest.mark.parametrize("batch", [1, 5, 16, 64, 256])
def test_gpu_full_width(mode, n, variable, batch):
    device = torch.device("cuda")
    table = make_table(batch + 3, FULL_W, device, seed=batch)
    idx, seq_lens, ext = make_batch(mode, batch, FULL_W, batch + 3, n, device, seed=batch, variable=variable)
    ref, gots = _bounded(mode, table, idx, seq_lens, ext, n, 64, 2048, dests=2)
    want = MetadataBuffers.allocate(mode, batch, FULL_W, 64, device, num_draft_tokens=n, rows=ref.rows)
    context_wide_metadata(mode, table, idx, seq_lens, want, index_topk=64, page_size=64, num_draft_tokens=n,
                          extend_seq_lens=ext)
    for got in gots:
        assert_writes_exactly(got, ref, mode, seq_lens, n, ext)
        assert_written_equal(got, want, mode, seq_lens, n, ext)


@pytest.mark.gpu
@pytest.mark.parametrize("mode,n", [(Mode.DECODE, 1), (Mode.TARGET_VERIFY, 6), (Mode.DRAFT_EXTEND, 6)])
def test_gpu_graph_replay_new_lengths_no_recompile(mode, n):
    """Capture one launch, replay it with longer and shorter lengths; the Triton cache does not grow."""
    from dsaspec.ops.dsa_metadata import _bounded_kernel

    device = torch.device("cuda")
    B, pool = 16, 20
    table = make_table(pool, FULL_W, device, seed=1)
    idx = torch.randint(0, pool, (B,), device=device)
    seq_lens = torch.ones(B, dtype=torch.int32, device=device)
    out = MetadataBuffers.allocate(mode, B, FULL_W, 64, device, num_draft_tokens=n)

    def launch():
        bounded_metadata(mode, table, idx, seq_lens, out, index_topk=2048, page_size=64,
                         num_draft_tokens=n, check_values=False)

    launch()
    torch.cuda.synchronize()
    compiled = len(_bounded_kernel.device_caches[device.index or 0][0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    cap = FULL_W - n
    for lengths in ([1000] * B, [cap] * 2 + [65536] * (B - 2), [1, 0, 63, 64, 65, 127, 128, 129] * 2, [7] * B):
        seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        table.copy_(make_table(pool, FULL_W, device, seed=lengths[0]))
        graph.replay()
        want = MetadataBuffers.allocate(mode, B, FULL_W, 64, device, num_draft_tokens=n)
        context_wide_metadata(mode, table, idx, seq_lens, want, index_topk=2048, page_size=64, num_draft_tokens=n)
        assert_written_equal(out, want, mode, seq_lens, n)
    assert len(_bounded_kernel.device_caches[device.index or 0][0]) == compiled


@pytest.mark.gpu
@pytest.mark.parametrize("mode,n,variable", CASES)
@pytest.mark.parametrize("block_cols,num_warps", [(512, 4), (256, 2), (1024, 4)])
def test_gpu_vector_rows(mode, n, variable, block_cols, num_warps):
    """16-byte aligned rows (table stride and row_align a multiple of 4) with blocks wide enough
    for 16-byte vectors: the same contract region, the same untouched tails."""
    device = torch.device("cuda")
    batch, pool = 16, 19
    table = torch.empty(pool, FULL_W + 2, dtype=torch.int32, device=device)[:, :FULL_W]
    table.copy_(make_table(pool, FULL_W, device, seed=3))
    lengths = [65536, 65536 + 5, 1, 0, 127, 128, 129, FULL_W - n] * 2
    idx, seq_lens, ext = make_batch(mode, batch, FULL_W, pool, n, device, seed=9, lengths=lengths, variable=variable)
    ref, gots = _bounded(mode, table, idx, seq_lens, ext, n, 64, 2048, dests=2, block_cols=block_cols,
                         num_warps=num_warps, alloc=dict(row_align=4))
    for got in gots:
        assert got.page_table_1.stride(0) % 4 == 0
        assert_writes_exactly(got, ref, mode, seq_lens, n, ext)


@pytest.mark.gpu
def test_gpu_int64_offsets():
    """rows * W > 2^31: the last rows' addresses overflow int32."""
    device = torch.device("cuda")
    mode, n, B = Mode.TARGET_VERIFY, 6, 400  # 2400 rows * 1,048,586 columns ~ 2.5e9 > 2^31
    table = make_table(8, FULL_W, device)
    idx = torch.randint(0, 8, (B,), device=device)
    seq_lens = torch.full((B,), 200, dtype=torch.int32, device=device)
    seq_lens[-1] = FULL_W - n
    out = MetadataBuffers.allocate(mode, B, FULL_W, 64, device, num_draft_tokens=n)
    bounded_metadata(mode, table, idx, seq_lens, out, index_topk=2048, page_size=64, num_draft_tokens=n)
    last = table[idx[-1]]
    assert torch.equal(out.page_table_1[-1], last)
    assert torch.equal(out.page_table_1[-n], last)
    assert torch.equal(out.real_page_table[-1], last[::64] // 64)


def test_zero_row_variable_extend_into_two_destinations():
    """A variable draft extend whose only request extends by 0 rows, written into two buffer sets
    (the empty outputs' views have no data pointer: their layouts must still match)."""
    table = make_table(4, 300, "cpu", seed=1)
    idx, seq_lens = torch.tensor([1]), torch.tensor([0], dtype=torch.int32)
    ext = torch.tensor([0], dtype=torch.int32)
    ref, gots = _bounded(Mode.DRAFT_EXTEND, table, idx, seq_lens, ext, 5, 64, 8, dests=2)
    for got in gots:
        assert got.rows == 0
        assert_contract_equal(got, ref, Mode.DRAFT_EXTEND, seq_lens, 5, ext)
