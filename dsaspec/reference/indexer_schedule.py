"""Reference indexer schedule: the even split of live KV blocks over SMs, in plain Python."""

from __future__ import annotations

import torch


def _row_blocks(seqlens: torch.Tensor, block_kv: int, skip_len: int) -> list[int]:
    """Blocks of each row: ``cdiv(length, block_kv)``, none for a length ``<= skip_len``."""
    return [-(-int(length) // block_kv) if int(length) > skip_len else 0
            for length in seqlens.tolist()]


def reference_indexer_schedule(seqlens: torch.Tensor, num_sms: int, block_kv: int = 64,
                               skip_len: int = 0) -> torch.Tensor:
    """``[num_sms + 1, 2]`` int32: SM ``i`` starts at global block
    ``g_i = i * (total // num_sms) + min(i, total % num_sms)``, given as (row, block in row) with
    rows without blocks skipped; ``(R, 0)`` once every block is handed out. A row has
    ``cdiv(length, block_kv)`` blocks when its length exceeds ``skip_len`` (and 0), else none.
    """
    blocks = _row_blocks(seqlens, block_kv, skip_len)
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
                    skip_len: int = 0) -> list[list[tuple[int, int]]]:
    """The (row, block) pairs each SM walks under ``schedule``: from ``schedule[i]`` up to, not
    including, ``schedule[i + 1]``, row-major, over the scheduled blocks of ``seqlens``."""
    blocks = _row_blocks(seqlens, block_kv, skip_len)
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
