"""Replay metadata against the plain-torch oracle (dsaspec/reference/dsa_metadata.py): the
context-wide kernel exactly on the written region (the tile-rounded live prefix of each row; every
cell past it keeps its poison); both kernels' 1-D outputs at large batches and row counts; what
both kernels do with unchecked bad values (``check_values=False``): nothing outside the inputs is
read and nothing outside the outputs is written; argument errors."""

import pytest
import torch

from dsaspec.ops import dsa_metadata_common
from dsaspec.ops.baseline.dsa_metadata import context_wide_metadata
from dsaspec.ops.dsa_metadata import bounded_metadata
from dsaspec.ops.dsa_metadata_common import MetadataBuffers
from dsaspec.forward_mode import Mode
from dsaspec.reference.dsa_metadata import ONE_D_OUTPUTS, assert_contract_equal, reference_metadata
from metadata_cases import (READ_POISON, WRITE_POISON, assert_writes_exactly, make_batch, make_table,
                            poisoned_buffers, poisoned_table)

CASES = [
    (Mode.DECODE, 1, False),
    (Mode.TARGET_VERIFY, 5, False),
    (Mode.DRAFT_EXTEND, 6, False),
    (Mode.DRAFT_EXTEND, 4, True),
]
KERNELS = ["context_wide", "bounded"]


def run(kernel, mode, table, idx, seq_lens, out, *, n=1, ext=None, page_size=64, topk=64, budget=None, **kw):
    args = dict(index_topk=topk, page_size=page_size, num_draft_tokens=n, extend_seq_lens=ext, **kw)
    if kernel == "bounded":
        bounded_metadata(mode, table, idx, seq_lens, out, budget=budget or 3 * seq_lens.shape[0], **args)
    else:
        context_wide_metadata(mode, table, idx, seq_lens, out, **args)


def assert_one_d_equal(got, want):
    for name in ONE_D_OUTPUTS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize("mode,n,variable", CASES)
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("width,batch", [(300, 11), (129, 3), (6, 1)])
def test_context_wide_matches_reference(device, mode, n, variable, page_size, width, batch):
    table = poisoned_table(9, width, device)
    idx, seq_lens, ext = make_batch(mode, batch, width, 9, n, device, variable=variable)
    ref = reference_metadata(mode, table, idx, seq_lens, index_topk=64, page_size=page_size,
                             num_draft_tokens=n, extend_seq_lens=ext)
    out, arenas = poisoned_buffers(mode, batch, width, page_size, device, num_draft_tokens=n, rows=ref.rows)
    run("context_wide", mode, table, idx, seq_lens, out, n=n, ext=ext, page_size=page_size)
    assert_writes_exactly(out, ref, mode, seq_lens, n, ext)
    assert (out.real_page_table is None) == (page_size == 1)
    assert all(a.outside_untouched() for a in arenas)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode,n,variable", CASES)
def test_tile_rounded_live_prefix_at_tile_edges(device, kernel, mode, n, variable):
    """Live lengths (``s + N`` for target verify) on and around the 128-column tile edges: a
    program whose tile starts at the live length writes nothing, one that starts below it writes
    its whole tile."""
    width = 400
    extra = n if mode is Mode.TARGET_VERIFY else 0
    lives = [0, 1, 127, 128, 129, 255, 256, 257, width]
    lengths = [max(live - extra, 0) for live in lives]
    table = poisoned_table(5, width, device, seed=11)
    idx, seq_lens, ext = make_batch(mode, len(lengths), width, 5, n, device, seed=12, lengths=lengths,
                                    variable=variable)
    ref = reference_metadata(mode, table, idx, seq_lens, index_topk=64, page_size=64, num_draft_tokens=n,
                             extend_seq_lens=ext)
    out, arenas = poisoned_buffers(mode, len(lengths), width, 64, device, num_draft_tokens=n, rows=ref.rows)
    run(kernel, mode, table, idx, seq_lens, out, n=n, ext=ext, budget=7)
    assert_writes_exactly(out, ref, mode, seq_lens, n, ext)
    assert all(a.outside_untouched() for a in arenas)


@pytest.mark.parametrize("kernel,mode,n,variable,batch", [
    ("bounded", Mode.DRAFT_EXTEND, 3, True, 256),     # binary search over 256 requests, 7 length programs
    ("context_wide", Mode.TARGET_VERIFY, 2, False, 256),
])
def test_large_batch_matches_reference(device, kernel, mode, n, variable, batch):
    """Batch 256 on a narrow table (every batch 1..256, every mode: gpu-marked below)."""
    width = 5
    table = poisoned_table(batch + 1, width, device, seed=batch)
    idx, seq_lens, ext = make_batch(mode, batch, width, batch + 1, n, device, seed=batch, variable=variable)
    ref = reference_metadata(mode, table, idx, seq_lens, index_topk=4, page_size=2, num_draft_tokens=n,
                             extend_seq_lens=ext)
    out, arenas = poisoned_buffers(mode, batch, width, 2, device, num_draft_tokens=n, rows=ref.rows)
    run(kernel, mode, table, idx, seq_lens, out, n=n, ext=ext, page_size=2, topk=4, budget=batch)
    assert_contract_equal(out, ref, mode, seq_lens, n, ext)
    assert all(a.outside_untouched() for a in arenas)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode,n,variable", CASES)
def test_length_programs_split_rows_exactly(device, monkeypatch, kernel, mode, n, variable):
    """Rows spread over many small length programs (chunks of 4): no prefix sum breaks at a seam."""
    monkeypatch.setattr(dsa_metadata_common, "MAX_CHUNK_R", 4)
    table = make_table(7, 140, device, seed=3)
    idx, seq_lens, ext = make_batch(mode, 9, 140, 7, n, device, seed=4, variable=variable)
    ref = reference_metadata(mode, table, idx, seq_lens, index_topk=70, page_size=64, num_draft_tokens=n,
                             extend_seq_lens=ext)
    out, arenas = poisoned_buffers(mode, 9, 140, 64, device, num_draft_tokens=n, rows=ref.rows)
    run(kernel, mode, table, idx, seq_lens, out, n=n, ext=ext, topk=70)
    assert_contract_equal(out, ref, mode, seq_lens, n, ext)
    assert all(a.outside_untouched() for a in arenas)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode,variable", [(Mode.DECODE, False), (Mode.TARGET_VERIFY, False),
                                          (Mode.DRAFT_EXTEND, False), (Mode.DRAFT_EXTEND, True)])
def test_gpu_every_batch_to_256_matches_reference(kernel, mode, variable):
    """Every batch 1..256 with N = 8 (rows up to 2048) and N = 1..7 cycling, 1-D outputs and
    page tables against the oracle, nothing written outside the buffers."""
    device = torch.device("cuda")
    width = 1000 + 4 + 8
    table = poisoned_table(260, width, device, seed=1)
    for batch in range(1, 257):
        n = 1 if mode is Mode.DECODE else (8 if batch % 2 == 0 else 1 + batch % 7)
        idx, seq_lens, ext = make_batch(mode, batch, width, 260, n, device, seed=batch, variable=variable)
        ref = reference_metadata(mode, table, idx, seq_lens, index_topk=700, page_size=64, num_draft_tokens=n,
                                 extend_seq_lens=ext)
        out, arenas = poisoned_buffers(mode, batch, width, 64, device, num_draft_tokens=n, rows=ref.rows)
        run(kernel, mode, table, idx, seq_lens, out, n=n, ext=ext, topk=700, budget=2048)
        assert_contract_equal(out, ref, mode, seq_lens, n, ext)
        assert all(a.outside_untouched() for a in arenas), batch


def test_decode_expanded_is_cache_seqlens(device):
    out = MetadataBuffers.allocate(Mode.DECODE, 3, 64, 64, device)
    assert out.seqlens_expanded.data_ptr() == out.cache_seqlens.data_ptr()


def test_int64_inputs_and_draft_extend_clamp(device):
    table = make_table(4, 256, device)
    idx = torch.tensor([0, 3], dtype=torch.int64, device=device)
    seq_lens = torch.tensor([200, 1], dtype=torch.int64, device=device)  # padded row: s = 1 < N
    out = MetadataBuffers.allocate(Mode.DRAFT_EXTEND, 2, 256, 64, device, num_draft_tokens=4)
    context_wide_metadata(Mode.DRAFT_EXTEND, table, idx, seq_lens, out, index_topk=2048, page_size=64,
                          num_draft_tokens=4)
    assert out.seqlens_expanded.tolist() == [197, 198, 199, 200, 0, 0, 0, 1]
    assert out.dsa_cu_seqlens_k.tolist()[-1] == 197 + 198 + 199 + 200 + 1


# ---------------------------------------------------------------- check_values=False: bad values stay in bounds

def _unchecked(kernel, mode, n, seq_lens, idx, ext=None, rows=None, pool=5, width=200):
    device = seq_lens.device
    table = poisoned_table(pool, width, device, seed=7)
    out, arenas = poisoned_buffers(mode, seq_lens.shape[0], width, 64, device, num_draft_tokens=n, rows=rows)
    with pytest.raises(ValueError):  # the precondition is checked when asked to
        run(kernel, mode, table, idx, seq_lens, out, n=n, ext=ext, check_values=True)
    run(kernel, mode, table, idx, seq_lens, out, n=n, ext=ext, check_values=False)
    assert all(a.outside_untouched() for a in arenas), "wrote outside the output buffers"
    for t in out.tensors():
        assert not (t == READ_POISON).any(), "read outside req_to_token"
    return table, out


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode,n", [(Mode.DECODE, 1), (Mode.TARGET_VERIFY, 2)])
def test_unchecked_pool_index_out_of_range_is_skipped(device, kernel, mode, n):
    idx = torch.tensor([1, -1, 5, 4], device=device)  # pool has 5 rows
    seq_lens = torch.tensor([150, 150, 150, 150], dtype=torch.int32, device=device)
    table, out = _unchecked(kernel, mode, n, seq_lens, idx)
    for b, ok in enumerate([True, False, False, True]):
        rows = out.page_table_1[b * n:(b + 1) * n]
        if ok:
            assert torch.equal(rows[:, :150], table[idx[b]][None, :150].expand(n, -1))
        else:
            assert (rows == WRITE_POISON).all()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode,n,lengths", [(Mode.DECODE, 1, [250, 3]), (Mode.TARGET_VERIFY, 3, [199, 0]),
                                            (Mode.DRAFT_EXTEND, 2, [-5, 201])])
def test_unchecked_lengths_past_width_or_negative(device, kernel, mode, n, lengths):
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    table, out = _unchecked(kernel, mode, n, seq_lens, torch.tensor([2, 0], device=device))
    want = reference_metadata(mode, table, torch.tensor([2, 0], device=device), seq_lens, index_topk=64,
                              page_size=64, num_draft_tokens=n)
    # Lengths follow the same formulas whatever s is; page tables hold the live prefix cut to [0, W].
    inside = seq_lens.clamp(0, table.shape[1] - (n if mode is Mode.TARGET_VERIFY else 0))
    assert_one_d_equal(out, want)
    assert_contract_equal(out, want, mode, inside, n)


@pytest.mark.parametrize("kernel", KERNELS)
def test_unchecked_negative_extend_lengths_count_as_zero(device, kernel):
    seq_lens = torch.tensor([100, 5, 120], dtype=torch.int32, device=device)
    idx = torch.tensor([0, 1, 2], device=device)
    ext = torch.tensor([3, -2, 3], dtype=torch.int32, device=device)
    table, out = _unchecked(kernel, Mode.DRAFT_EXTEND, 2, seq_lens, idx, ext=ext, rows=6)
    clamped = torch.tensor([3, 0, 3], dtype=torch.int32, device=device)
    want = reference_metadata(Mode.DRAFT_EXTEND, table, idx, seq_lens, index_topk=64, page_size=64,
                              num_draft_tokens=2, extend_seq_lens=clamped)
    assert_contract_equal(out, want, Mode.DRAFT_EXTEND, seq_lens, 2, clamped)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("ext", [[1, 0, 2], [4, 4, 4]])
def test_unchecked_wrong_extend_total(device, kernel, ext):
    """sum(extend_seq_lens) != rows: rows past the sum get length 0 and an unwritten page-table
    row; requests past the last row are dropped."""
    seq_lens = torch.tensor([100, 5, 200], dtype=torch.int32, device=device)
    ext = torch.tensor(ext, dtype=torch.int32, device=device)
    _, out = _unchecked(kernel, Mode.DRAFT_EXTEND, 2, seq_lens, torch.tensor([0, 1, 2], device=device),
                        ext=ext, rows=6)
    total = int(ext.sum())
    if total < 6:
        assert out.seqlens_expanded[total:].tolist() == [0] * (6 - total)
        assert out.dsa_cache_seqlens[total:].tolist() == [0] * (6 - total)
        assert len(set(out.dsa_cu_seqlens_k[total:].tolist())) == 1
        assert (out.page_table_1[total:] == WRITE_POISON).all()


# ---------------------------------------------------------------- argument errors

def _call(mode=Mode.DECODE, **over):
    device = over.pop("device")
    table = over.pop("table", make_table(4, 128, device))
    args = dict(req_pool_indices=torch.tensor([0, 1], device=device),
                seq_lens=torch.tensor([5, 6], device=device, dtype=torch.int32))
    args.update({k: over.pop(k) for k in list(over) if k in args})
    out = over.pop("out", None) or MetadataBuffers.allocate(mode, 2, 128, 64, device,
                                                           num_draft_tokens=over.get("num_draft_tokens", 1))
    kw = dict(index_topk=64, page_size=64)
    kw.update(over)
    context_wide_metadata(mode, table, args["req_pool_indices"], args["seq_lens"], out, **kw)


@pytest.mark.parametrize("change,message", [
    (dict(seq_lens=torch.tensor([5, 200], dtype=torch.int32)), "^seq_len = 200 exceeds the page-table width W=128$"),
    (dict(seq_lens=torch.tensor([5.0, 6.0])), r"^seq_lens must be int32/int64 \[B\], got torch.float32 \(2,\)$"),
    (dict(req_pool_indices=torch.tensor([0, 9])), r"^req_pool_indices must lie in \[0, 4\)$"),
    (dict(req_pool_indices=torch.tensor([0])), "^req_pool_indices has 1 entries, seq_lens has 2$"),
    (dict(page_size=32), "^out was allocated for page_size 64, called with 32$"),
    (dict(table=torch.zeros(4, 128, dtype=torch.int64)), r"^req_to_token must be int32 \[pool, W\], got torch.int64"),
    (dict(seq_lens=torch.tensor([-1, 6], dtype=torch.int32)), "^seq_lens must be >= 0$"),
    (dict(seq_lens=torch.tensor([5, 0, 6, 0], dtype=torch.int32)[::2]), "^seq_lens must be contiguous, got stride 2$"),
    (dict(index_topk=0), "^index_topk must be >= 1, got 0$"),
])
def test_bad_input_names_the_argument(device, change, message):
    change = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in change.items()}
    with pytest.raises(ValueError, match=message):
        _call(device=device, **change)


def test_width_too_small_and_wrong_mode(device):
    small = MetadataBuffers.allocate(Mode.DECODE, 2, 64, 64, device)
    with pytest.raises(ValueError, match="^out.page_table_1 is 64 wide, narrower than req_to_token's W=128$"):
        _call(device=device, out=small)
    verify = MetadataBuffers.allocate(Mode.TARGET_VERIFY, 2, 128, 64, device, num_draft_tokens=2)
    with pytest.raises(ValueError, match="^out was allocated for target_verify, called with decode$"):
        _call(device=device, out=verify)
    with pytest.raises(ValueError, match="^out has 4 rows, target_verify needs 6$"):
        _call(Mode.TARGET_VERIFY, device=device, out=verify, num_draft_tokens=3)


def test_extend_errors(device):
    out = MetadataBuffers.allocate(Mode.DRAFT_EXTEND, 2, 128, 64, device, rows=3)
    ext = torch.tensor([1, 2], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="^extend_seq_lens is only for draft extend, not decode$"):
        _call(device=device, extend_seq_lens=ext)
    with pytest.raises(ValueError, match=r"^extend_seq_lens must be int32/int64 \[2\], got torch.int32 \(3,\)$"):
        _call(Mode.DRAFT_EXTEND, device=device, out=out, extend_seq_lens=torch.ones(3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=r"^sum\(extend_seq_lens\) = 5 but out has 3 rows$"):
        _call(Mode.DRAFT_EXTEND, device=device, out=out, extend_seq_lens=ext + 1)
    with pytest.raises(ValueError, match="^extend_seq_lens must be >= 0$"):
        _call(Mode.DRAFT_EXTEND, device=device, out=out, extend_seq_lens=torch.tensor([4, -1], device=device))


def test_buffer_errors(device):
    with pytest.raises(ValueError, match="^row_align must be >= 1, got 0$"):
        MetadataBuffers.allocate(Mode.DECODE, 2, 128, 64, device, row_align=0)
    with pytest.raises(ValueError, match="^decode has one row per request: rows must equal batch=2, got 3$"):
        MetadataBuffers.allocate(Mode.DECODE, 2, 128, 64, device, rows=3)
    a = MetadataBuffers.allocate(Mode.DECODE, 2, 128, 64, device)
    b = MetadataBuffers.allocate(Mode.DECODE, 2, 128, 1, device)  # no real page table
    assert not a.same_layout(b) and not b.same_layout(a)
    assert a.same_layout(MetadataBuffers.allocate(Mode.DECODE, 2, 128, 64, device))
    assert not a.same_layout(MetadataBuffers.allocate(Mode.DECODE, 2, 128, 64, device, row_align=16))
