"""MTP draft-decode metadata: one bounded launch vs precompute + copies, and the copy kernel."""

import dataclasses

import pytest
import torch

from dsaspec.ops.baseline import draft_decode_metadata as ddm
from dsaspec.ops.dsa_metadata_common import MetadataBuffers
from dsaspec.forward_mode import Mode
from dsaspec.ops.baseline.draft_decode_metadata import copy_metadata, precompute_and_copy
from dsaspec.ops.draft_decode_metadata import draft_decode_metadata
from dsaspec.reference.dsa_metadata import assert_written_equal, reference_metadata
from metadata_cases import make_batch, make_table

W = 333


def _buffers(n, device, batch=6, page_size=64):
    return [MetadataBuffers.allocate(Mode.DECODE, batch, W, page_size, device) for _ in range(n)]


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("page_size", [1, 64])
def test_one_launch_matches_precompute_and_copy(device, steps, page_size):
    table = make_table(8, W, device, seed=steps)
    idx, seq_lens, _ = make_batch(Mode.DECODE, 6, W, 8, 1, device, seed=steps)
    scratch = _buffers(1, device, page_size=page_size)[0]
    copied = _buffers(steps, device, page_size=page_size)
    launched = _buffers(steps, device, page_size=page_size)
    for out in copied + launched:
        for t in out.tensors():
            t.fill_(-5)
    precompute_and_copy(table, idx, seq_lens, scratch, copied, index_topk=64, page_size=page_size)
    draft_decode_metadata(table, idx, seq_lens, launched, index_topk=64, page_size=page_size, budget=12)
    ref = reference_metadata(Mode.DECODE, table, idx, seq_lens, index_topk=64, page_size=page_size)
    for got, want in zip(launched, copied):
        assert_written_equal(got, want, Mode.DECODE, seq_lens)
        assert_written_equal(got, ref, Mode.DECODE, seq_lens)
    for out in copied:  # the baseline copies every column, the scratch's full width
        for got, want in zip(out.tensors(), scratch.tensors()):
            assert torch.equal(got, want)


@pytest.mark.parametrize("steps,want", [(1, [1]), (2, [1, 1]), (3, [3]), (4, [3, 1]), (5, [3, 1, 1])])
def test_precompute_and_copy_copies_like_sglang(device, steps, want):
    """The copies after the scratch write (SGLang's multi-step precompute): with three or more step
    backends one 3-destination copy then one copy per further backend, with fewer one copy each."""
    table = make_table(8, W, device)
    idx, seq_lens, _ = make_batch(Mode.DECODE, 6, W, 8, 1, device)
    seen = []

    def hook(*args, **kwargs):
        seen.append(kwargs["NUM_DEST"])

    ddm._copy_kernel.pre_run_hooks.append(hook)
    try:
        precompute_and_copy(table, idx, seq_lens, _buffers(1, device)[0], _buffers(steps, device),
                            index_topk=64, page_size=64)
    finally:
        ddm._copy_kernel.pre_run_hooks.remove(hook)
    assert seen == want


def test_copy_metadata_rejects_bad_destinations(device):
    src, a, b, c, d = _buffers(5, device)
    with pytest.raises(ValueError, match="1 to 3 buffer sets per copy, got 4"):
        copy_metadata(src, [a, b, c, d])
    with pytest.raises(ValueError, match="1 to 3 buffer sets per copy, got 0"):
        copy_metadata(src, [])
    other = MetadataBuffers.allocate(Mode.DECODE, 5, W, 64, device)
    with pytest.raises(ValueError, match=r"dsts\[1\] does not match the layout of src"):
        copy_metadata(src, [a, other])
    def strided(buffers):
        return dataclasses.replace(buffers, page_table_1=torch.zeros(6, W + 3, dtype=torch.int32, device=device)[:, :W])

    with pytest.raises(ValueError, match="does not match the layout"):
        copy_metadata(src, [strided(a)])
    with pytest.raises(ValueError, match="contiguous page tables"):
        copy_metadata(strided(src), [strided(a)])


def test_empty_step_list_is_an_error(device):
    table = make_table(2, W, device)
    idx = torch.zeros(6, dtype=torch.int64, device=device)
    seq_lens = torch.ones(6, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="at least one step backend"):
        draft_decode_metadata(table, idx, seq_lens, [], index_topk=64, page_size=64)
    with pytest.raises(ValueError, match="at least one step backend"):
        precompute_and_copy(table, idx, seq_lens, _buffers(1, device)[0], [], index_topk=64, page_size=64)
