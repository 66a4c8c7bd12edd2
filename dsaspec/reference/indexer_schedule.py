"""Reference indexer schedule: the even split of live KV blocks over SMs, in plain Python."""

from __future__ import annotations

import torch


def _unit_blocks(seqlens: torch.Tensor, block_kv: int, skip_len: int,
                 rows_per_group: int) -> list[int]:
    """Blocks of each group of ``rows_per_group`` rows: ``cdiv(L, block_kv)`` with ``L`` the
    longest member length above ``skip_len`` (and 0); none when there is no such member."""
    lengths = [int(length) if int(length) > max(skip_len, 0) else 0 for length in seqlens.tolist()]
    groups = [lengths[i:i + rows_per_group] for i in range(0, len(lengths), rows_per_group)]
    return [-(-max(group) // block_kv) for group in groups]


def reference_indexer_schedule(seqlens: torch.Tensor, num_sms: int, block_kv: int = 64,
                               skip_len: int = 0, rows_per_group: int = 1) -> torch.Tensor:
    """``[num_sms + 1, 2]`` int32: SM ``i`` starts at global block
    ``g_i = i * (total // num_sms) + min(i, total % num_sms)``, given as (unit, block in unit) with
    units without blocks skipped; ``(R / rows_per_group, 0)`` once every block is handed out.
    Units are groups of ``rows_per_group`` consecutive rows; a unit has ``cdiv(L, block_kv)``
    blocks, ``L`` the longest of its rows longer than ``skip_len`` (and 0), else none.
    """
    blocks = _unit_blocks(seqlens, block_kv, skip_len, rows_per_group)
    total = sum(blocks)
    out = torch.empty(num_sms + 1, 2, dtype=torch.int32, device=seqlens.device)
    for sm in range(num_sms + 1):
        start = sm * (total // num_sms) + min(sm, total % num_sms)
        row, first_block = 0, 0
        while row < len(blocks) and first_block + blocks[row] <= start:
            first_block += blocks[row]
            row += 1
        out[sm, 0] = row
        out[sm, 1] = start - first_block
    return out


def schedule_shares(schedule: torch.Tensor, seqlens: torch.Tensor, block_kv: int = 64,
                    skip_len: int = 0, rows_per_group: int = 1) -> list[list[tuple[int, int]]]:
    """The (unit, block) pairs each SM walks under ``schedule``: from ``schedule[i]`` up to, not
    including, ``schedule[i + 1]``, unit-major, over the scheduled blocks of ``seqlens``."""
    blocks = _unit_blocks(seqlens, block_kv, skip_len, rows_per_group)
    starts = [tuple(pair) for pair in schedule.tolist()]
    shares = []
    for (row, block), end in zip(starts[:-1], starts[1:]):
        share = []
        while (row, block) < end and row < len(blocks):
            if block < blocks[row]:
                share.append((row, block))
                block += 1
            else:
                row, block = row + 1, 0
        shares.append(share)
    return shares
