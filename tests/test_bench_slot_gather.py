"""dsaspec/bench/slot_gather.py: the gather yardstick folds exactly the entries of each program's
valid slots, on both MLA cache layouts; the gather-and-dequantize one folds exactly the dequantized
values of each program's valid ``fp8_ds_mla`` entries (checked against a by-hand e4m3 decode) and
every byte of an entry moves its fold."""

from __future__ import annotations

import functools
import operator
import struct
from types import SimpleNamespace

import pytest
import torch

from dsaspec.bench import timing
from dsaspec.bench.slot_gather import (SLOT_GATHER_GRIDS, fastest_slot_gather, reference_slot_gather,
                                       reference_slot_gather_dequant, slot_gather, slot_gather_dequant)
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
    if rows and topk:
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


# --- gather and dequantize (fp8_ds_mla only) ---

def _fp8_entries(slots=SLOTS, seed=1):
    """Well-formed ``fp8_ds_mla`` entries (uint8 ``[slots, 656]``) whose every byte stays finite
    with its lowest bit flipped: codes of either sign below 0x7E (0x7F is e4m3's NaN; zeros and
    subnormals included), scales of any mantissa in [2**-12, 2**3), bf16 normal rope values."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 0x7E, (slots, 512), generator=gen, dtype=torch.uint8)
    codes |= torch.randint(0, 2, (slots, 512), generator=gen, dtype=torch.uint8) << 7
    scales = (torch.rand(slots, 4, generator=gen) + 1) * 2.0 ** torch.randint(-12, 2, (slots, 4), generator=gen)
    rope = torch.randn(slots, 64, generator=gen).to(torch.bfloat16)
    return torch.cat([codes, scales.view(torch.uint8), rope.view(torch.uint8)], dim=1)


def _e4m3(code):
    """An e4m3fn code's value, decoded by hand (no NaN code here)."""
    exponent, mantissa = (code >> 3) & 0xF, code & 7
    magnitude = mantissa / 8 * 2.0 ** -6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    return -magnitude if code & 0x80 else magnitude


def _f32_bits(x):
    return struct.unpack("<i", struct.pack("<f", x))[0]    # rounded to fp32 once (x is exact in a double)


def _entry_sum_by_hand(entry):
    """An entry's 576 fp32 bit patterns summed (no wrap yet): each code times its group's scale,
    each rope value widened."""
    scales = struct.unpack("<4f", entry[512:528])
    words = [_f32_bits(_e4m3(code) * scales[i // 128]) for i, code in enumerate(entry[:512])]
    words += [struct.unpack("<i", b"\0\0" + entry[528 + 2 * j:530 + 2 * j])[0] for j in range(64)]
    return sum(words)


def _wrapped(total):
    return (total + 2**31) % 2**32 - 2**31


@functools.cache
def _fp8_sums_by_hand():
    return [_entry_sum_by_hand(bytes(entry)) for entry in _fp8_entries().tolist()]


@pytest.mark.parametrize("rows,topk,block", [(3, 1, 16), (2, 15, 16), (2, 16, 16), (2, 33, 16), (2, 65, 32),
                                             (2, 129, 128), (1, 200, 64), (0, 5, 16), (2, 0, 16)])
def test_slot_gather_dequant_folds_the_valid_slots_values(device, rows, topk, block):
    """Each program's wrapped sum over its valid slots (empty ones anywhere, a repeated id counted
    each time, a last row of nothing) of the by-hand decoded entries' sums, from the kernel and the
    reference alike."""
    cache = _fp8_entries().to(device)
    slots = _slots(rows, topk, device, seed=topk)
    blocks = -(-topk // block)
    out = torch.full((rows * blocks,), 7, dtype=torch.int32, device=device)
    slot_gather_dequant(cache, slots, out, block=block)
    sums = _fp8_sums_by_hand()
    want = [_wrapped(sum(sums[s] for s in slots[r, start:start + block].tolist() if s >= 0))
            for r in range(rows) for start in range(0, topk, block)]
    assert out.tolist() == want
    assert reference_slot_gather_dequant(cache, slots, block).tolist() == want


def _with_each_byte_flipped(entry, positions):
    """``entry`` (uint8 ``[656]``), then one copy a position with that byte's lowest bit flipped."""
    cache = entry.repeat(len(positions) + 1, 1)
    for row, position in enumerate(positions, start=1):
        cache[row, position] ^= 1
    return cache


def test_slot_gather_dequant_reads_every_byte_of_an_entry(device):
    """The lowest bit of any byte of an entry flipped (a code, a scale's mantissa or exponent, a rope
    value) moves its fold: every byte for the reference; for the kernel (one slot a program, equal to
    the reference) every scale byte and the first, middle and last bytes of each code group and of
    the rope values."""
    entry = _fp8_entries(slots=1, seed=2)[0]
    cache = _with_each_byte_flipped(entry, range(MLA_FP8_BYTES))
    folds = reference_slot_gather_dequant(cache, torch.arange(len(cache), dtype=torch.int32)[:, None], block=1)
    assert (folds[1:] != folds[0]).all()
    positions = [*(g * 128 + i for g in range(4) for i in (0, 63, 127)), *range(512, 528),
                 528, 529, 591, 592, 654, 655]
    cache = _with_each_byte_flipped(entry, positions).to(device)
    slots = torch.arange(len(cache), dtype=torch.int32, device=device)[:, None]
    out = slot_gather_dequant(cache, slots, torch.empty(len(cache), dtype=torch.int32, device=device), block=2)
    assert out.tolist() == [folds[0].item(), *folds[1:][positions].tolist()]


def test_slot_gather_dequant_refuses_bad_arguments(device):
    cache = _fp8_entries(slots=8).to(device)
    slots = torch.zeros(2, 64, dtype=torch.int32, device=device)
    out = torch.empty(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="cache"):          # the bf16 cache has no codes to dequantize
        slot_gather_dequant(torch.zeros(8, 576, dtype=torch.bfloat16, device=device), slots, out)
    with pytest.raises(ValueError, match="cache"):
        slot_gather_dequant(torch.zeros(8, 576, dtype=torch.uint8, device=device), slots, out)
    with pytest.raises(ValueError, match="cache"):          # rows not 16-byte aligned
        slot_gather_dequant(torch.zeros(8, MLA_FP8_BYTES + 4, dtype=torch.uint8, device=device)[:, :MLA_FP8_BYTES],
                            slots, out)
    with pytest.raises(ValueError, match="slots"):
        slot_gather_dequant(cache, slots.long(), out)
    with pytest.raises(ValueError, match="out"):
        slot_gather_dequant(cache, slots, out.float())
    with pytest.raises(ValueError, match="out"):
        slot_gather_dequant(cache, slots, torch.empty(3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="block"):
        slot_gather_dequant(cache, slots, out, block=48)


@pytest.mark.parametrize("gather", [slot_gather, slot_gather_dequant])
def test_fastest_slot_gather_times_each_grid_with_its_out(device, monkeypatch, gather):
    """Each grid's launch gets an ``out`` its gather accepts (no rows: checked, nothing run); the
    fastest grid is kept."""
    times = iter([5.0, 3.0, 4.0, 2.5, 6.0, 7.0])
    launched = []

    def fake_time_in_graph(fn, iters, graph_diff):
        launched.append(fn())
        return SimpleNamespace(median_us=next(times))

    monkeypatch.setattr(timing, "time_in_graph", fake_time_in_graph)
    cache = _fp8_entries(slots=8).to(device)
    slots = torch.zeros(0, 100, dtype=torch.int32, device=device)
    assert fastest_slot_gather(cache, slots, iters=3, gather=gather) == (2.5, "64 x 8w")
    assert len(launched) == len(SLOT_GATHER_GRIDS) and all(out.dtype == torch.int32 for out in launched)
