"""dsaspec/bench/slot_gather.py: the gather yardstick folds exactly the entries of each program's
valid slots, on both MLA cache layouts."""

from __future__ import annotations

import functools
import operator

import pytest
import torch

from dsaspec.bench.slot_gather import reference_slot_gather, slot_gather
from dsaspec.ops.kv_cache_layout import MLA_FP8_BYTES

SLOTS = 200


def _caches(device):
    gen = torch.Generator().manual_seed(0)
    bf16 = torch.randn(SLOTS, 576, generator=gen).to(torch.bfloat16)
    fp8 = torch.randint(0, 256, (SLOTS, MLA_FP8_BYTES), generator=gen, dtype=torch.uint8)
    return {"bf16": bf16.to(device), "fp8_ds_mla": fp8.to(device)}


def _slots(rows, topk, device, seed):
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, SLOTS, (rows, topk), generator=gen, dtype=torch.int32)
    slots[torch.rand(rows, topk, generator=gen) < 0.2] = -1         # empty slots, anywhere
    if topk:
        slots[0, : topk // 2] = slots[0, 0].clamp(min=0)              # repeated ids
        slots[-1] = -1                                                # a row of nothing
    return slots.to(device)


def _by_hand(cache, slots, block):
    """Each program's XOR, one word at a time in Python."""
    words = cache.cpu().contiguous().view(torch.int32)
    rows, topk = slots.shape
    out = []
    for r in range(rows):
        for start in range(0, topk, block):
            ids = [s for s in slots[r, start:start + block].tolist() if s >= 0]
            out.append(functools.reduce(operator.xor, (w for s in ids for w in words[s].tolist()), 0))
    return out


@pytest.mark.parametrize("layout", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("rows,topk,block", [(3, 1, 64), (2, 63, 64), (2, 64, 64), (2, 65, 32), (2, 129, 128),
                                             (1, 200, 64)])
def test_slot_gather_folds_the_valid_slots_entries(device, layout, rows, topk, block):
    cache = _caches(device)[layout]
    slots = _slots(rows, topk, device, seed=topk)
    blocks = -(-topk // block)
    out = torch.full((rows * blocks,), 7, dtype=torch.int32, device=device)
    slot_gather(cache, slots, out, block=block)
    want = _by_hand(cache, slots, block)
    assert out.tolist() == want
    assert reference_slot_gather(cache, slots, block).tolist() == want


def test_slot_gather_reads_every_word_of_an_entry(device):
    """One changed word at the entry's last byte (the FP8 rope's end, past the last full chunk)
    moves the fold of the program holding that slot only."""
    cache = _caches(device)["fp8_ds_mla"].clone()
    slots = torch.tensor([[5, 9], [7, -1]], dtype=torch.int32, device=device)
    before = slot_gather(cache, slots, torch.empty(2, dtype=torch.int32, device=device), block=64).clone()
    cache[9, -1] ^= 0x80
    after = slot_gather(cache, slots, torch.empty(2, dtype=torch.int32, device=device), block=64)
    assert after[0] != before[0] and after[1] == before[1]


def test_slot_gather_refuses_bad_arguments(device):
    cache = _caches(device)["bf16"]
    slots = torch.zeros(2, 64, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="slots"):
        slot_gather(cache, slots.long(), torch.empty(2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="out"):
        slot_gather(cache, slots, torch.empty(3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="cache"):
        slot_gather(torch.zeros(SLOTS, 3, dtype=torch.uint8, device=device), slots,
                    torch.empty(2, dtype=torch.int32, device=device))
