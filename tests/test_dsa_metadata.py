"""Context-wide replay metadata against the pure-PyTorch reference: exact over the full width."""

import pytest
import torch

from dsaspec.ops.dsa_metadata import context_wide_metadata

from dsaspec.ops.dsa_metadata_common import MetadataBuffers, Mode
from dsaspec.reference.dsa_metadata import reference_metadata
from metadata_cases import make_batch, make_table

CASES = [
    (Mode.DECODE, 1, False),
    (Mode.TARGET_VERIFY, 5, False),
    (Mode.DRAFT_EXTEND, 6, False),
    (Mode.DRAFT_EXTEND, 4, True),
]


@pytest.mark.parametrize("mode,n,variable", CASES)
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("width,batch", [(300, 11), (129, 3), (6, 1)])
def test_context_wide_matches_reference(device, mode, n, variable, page_size, width, batch):
    table = make_table(9, width, device)
    idx, seq_lens, ext = make_batch(mode, batch, width, 9, n, device, variable=variable)
    ref = reference_metadata(mode, table, idx, seq_lens, index_topk=64, page_size=page_size,
                             num_draft_tokens=n, extend_seq_lens=ext)
    out = MetadataBuffers.allocate(mode, batch, width, page_size, device, num_draft_tokens=n, rows=ref.rows)
    out.page_table_1.fill_(-3)
    context_wide_metadata(mode, table, idx, seq_lens, out, index_topk=64, page_size=page_size,
                          num_draft_tokens=n, extend_seq_lens=ext)
    assert torch.equal(out.lengths, ref.lengths)
    assert torch.equal(out.page_table_1, ref.page_table_1)
    if page_size > 1:
        assert torch.equal(out.real_page_table, ref.real_page_table)
    else:
        assert out.real_page_table is None


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


def _call(mode=Mode.DECODE, **over):
    device = over.pop("device")
    table = over.pop("table", make_table(4, 128, device))
    args = dict(req_pool_indices=torch.tensor([0, 1], device=device),
                seq_lens=torch.tensor([5, 6], device=device, dtype=torch.int32))
    args.update({k: over.pop(k) for k in list(over) if k in args})
    out = over.pop("out", None) or MetadataBuffers.allocate(mode, 2, 128, 64, device, num_draft_tokens=over.get("num_draft_tokens", 1))
    kw = dict(index_topk=64, page_size=64)
    kw.update(over)
    context_wide_metadata(mode, table, args["req_pool_indices"], args["seq_lens"], out, **kw)


@pytest.mark.parametrize("change,message", [
    (dict(seq_lens=torch.tensor([5, 200], dtype=torch.int32)), "exceeds the page-table width"),
    (dict(seq_lens=torch.tensor([5.0, 6.0])), "seq_lens must be int32/int64"),
    (dict(req_pool_indices=torch.tensor([0, 9])), r"req_pool_indices must lie in \[0, 4\)"),
    (dict(req_pool_indices=torch.tensor([0])), "req_pool_indices has 1 entries"),
    (dict(page_size=32), "allocated for page_size 64"),
    (dict(table=torch.zeros(4, 128, dtype=torch.int64)), "req_to_token must be int32"),
    (dict(seq_lens=torch.tensor([-1, 6], dtype=torch.int32)), "seq_lens must be >= 0"),
])
def test_bad_input_names_the_argument(device, change, message):
    change = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in change.items()}
    with pytest.raises(ValueError, match=message):
        _call(device=device, **change)


def test_width_too_small_and_wrong_mode(device):
    small = MetadataBuffers.allocate(Mode.DECODE, 2, 64, 64, device)
    with pytest.raises(ValueError, match="narrower than req_to_token's W=128"):
        _call(device=device, out=small)
    verify = MetadataBuffers.allocate(Mode.TARGET_VERIFY, 2, 128, 64, device, num_draft_tokens=2)
    with pytest.raises(ValueError, match="allocated for target_verify, called with decode"):
        _call(device=device, out=verify)
    with pytest.raises(ValueError, match="verify needs 6|has 2 rows"):
        _call(Mode.TARGET_VERIFY, device=device, out=verify, num_draft_tokens=3)
