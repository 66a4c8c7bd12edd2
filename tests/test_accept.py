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


def test_bad_shapes():
    with pytest.raises(ValueError, match=r"target_tokens must be \[2, 3\]"):
        greedy_accept(torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="must be 2-D"):
        greedy_accept(torch.zeros(2, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
