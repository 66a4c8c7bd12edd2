"""Greedy chain acceptance (speculative/accept.py) against the chain-walking reference."""

import pytest
import torch

from dsaspec.reference.accept import reference_greedy_accept
from dsaspec.speculative.accept import Acceptance, greedy_accept


def _check(drafts, targets, forced=0, out=None):
    forced_t = None if forced is None else torch.tensor([forced], dtype=torch.int64, device=drafts.device)
    got = greedy_accept(drafts, targets, forced_accept_len=forced_t, out=out)
    want_len, want_committed = reference_greedy_accept(drafts.tolist(), targets.tolist(), forced or 0)
    assert got.accept_len.tolist() == want_len
    assert got.committed.tolist() == want_committed
    assert got.bonus.tolist() == [row[a - 1] for row, a in zip(want_committed, want_len)]
    return got


@pytest.mark.parametrize("steps", [1, 2, 3, 5])
def test_random_chains_match_reference(steps, device):
    g = torch.Generator().manual_seed(steps)
    batch = 37
    targets = torch.randint(0, 4, (batch, steps + 1), generator=g)
    drafts = targets[:, :steps].clone()
    flips = torch.rand(batch, steps, generator=g) < 0.3            # each draft wrong with p = 0.3
    drafts[flips] = (drafts[flips] + 1 + torch.randint(0, 3, (int(flips.sum()),), generator=g)) % 4
    got = _check(drafts.to(device), targets.to(device))
    assert set(got.accept_len.tolist()) > {1}                      # the cases are not all trivial


def test_all_right_all_wrong(device):
    targets = torch.arange(24, device=device).view(4, 6)
    right = _check(targets[:, :5].clone(), targets)
    assert right.accept_len.tolist() == [6] * 4 and torch.equal(right.committed, targets)
    wrong = _check(targets[:, :5] + 100, targets)
    assert wrong.accept_len.tolist() == [1] * 4
    assert wrong.committed[:, 0].tolist() == targets[:, 0].tolist() and not wrong.committed[:, 1:].any()


def test_mismatch_after_a_match_stops_the_chain(device):
    # draft 2 wrong, draft 3 right again: only draft 1 is accepted
    targets = torch.tensor([[10, 11, 12, 13]], device=device)
    drafts = torch.tensor([[10, 99, 12]], device=device)
    got = _check(drafts, targets)
    assert got.accept_len.tolist() == [2] and got.committed.tolist() == [[10, 11, 0, 0]]


@pytest.mark.parametrize("forced", [1, 2, 3, 4, 7])
def test_forced_accept_len(forced, device):
    g = torch.Generator().manual_seed(forced)
    targets = torch.randint(0, 50, (9, 4), generator=g).to(device)
    drafts = torch.randint(0, 50, (9, 3), generator=g).to(device)
    got = _check(drafts, targets, forced)
    assert got.accept_len.tolist() == [min(forced, 4)] * 9


def test_writes_static_buffers(device):
    out = Acceptance(torch.full((8,), -7, device=device), torch.full((8, 3), -7, device=device),
                     torch.full((8,), -7, device=device))
    targets = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]], device=device)
    drafts = torch.tensor([[1, 2], [0, 5], [7, 0]], device=device)
    got = _check(drafts, targets, None, out=out)
    assert got.accept_len.data_ptr() == out.accept_len.data_ptr()
    assert out.accept_len.tolist() == [3, 1, 2] + [-7] * 5             # rows past B untouched
    assert out.committed[3:].eq(-7).all() and out.bonus.tolist()[:3] == [3, 4, 8]
    # the speculative worker's layout: accept_len and committed are column views of one buffer
    outputs = torch.full((8, 4), -7, device=device)
    strided = Acceptance(outputs[:, 0], outputs[:, 1:], torch.full((8,), -7, device=device))
    _check(drafts, targets, None, out=strided)
    assert outputs[:3].tolist() == [[3, 1, 2, 3], [1, 4, 0, 0], [2, 7, 8, 0]]


def test_bad_arguments_are_refused_before_any_write():
    """Each argument's dtype, shape and device is checked up front: the error names it and an
    ``out`` too small for the batch raises before any of its buffers is written."""
    long = dict(dtype=torch.int64)
    drafts, targets = torch.zeros(3, 2, **long), torch.zeros(3, 3, **long)
    cases = [
        (dict(drafts=torch.zeros(3, **long)), r"drafts: expected 2 dimensions, got shape \(3,\)"),
        (dict(drafts=drafts.int()), "drafts: expected dtype torch.int64, got torch.int32"),
        (dict(drafts=drafts.tolist()), "drafts: expected a torch.Tensor, got list"),
        (dict(target_tokens=targets[:, :2]), r"target_tokens: expected shape \(3, 3\) \(one more column"),
        (dict(target_tokens=targets.float()), "target_tokens: expected dtype torch.int64, got torch.float32"),
        (dict(target_tokens=targets.to("meta")), "target_tokens: expected device cpu, got meta"),
        (dict(forced_accept_len=torch.ones(2, **long)), r"forced_accept_len: expected shape \(1,\)"),
        (dict(forced_accept_len=torch.ones(1, dtype=torch.int32)), "forced_accept_len: expected dtype torch.int64"),
    ]
    for change, message in cases:
        arguments = dict(drafts=drafts, target_tokens=targets, forced_accept_len=None) | change
        with pytest.raises((ValueError, TypeError), match=message):
            greedy_accept(arguments.pop("drafts"), arguments.pop("target_tokens"), **arguments)

    def out(rows=(8, 8, 8), width=3, dtype=torch.int64):
        return Acceptance(torch.full((rows[0],), -7, dtype=dtype), torch.full((rows[1], width), -7, dtype=dtype),
                          torch.full((rows[2],), -7, dtype=dtype))

    for buffers, message in [
        (out(rows=(8, 2, 8)), r"out.committed: expected at least 3 rows \(one per request\), got shape \(2, 3\)"),
        (out(rows=(8, 8, 2)), r"out.bonus: expected at least 3 rows"),
        (out(rows=(2, 8, 8)), r"out.accept_len: expected at least 3 rows"),
        (out(width=4), r"out.committed: expected shape \('\*', 3\), got \(8, 4\)"),
        (out(dtype=torch.int32), "out.accept_len: expected dtype torch.int64, got torch.int32"),
    ]:
        with pytest.raises(ValueError, match=message):
            greedy_accept(drafts, targets, out=buffers)
        for tensor in (buffers.accept_len, buffers.committed, buffers.bonus):
            assert tensor.eq(-7).all()
