"""Reference indexer schedule: the even split of live KV blocks over SMs, in plain Python."""

from __future__ import annotations

import torch


def reference_indexer_schedule(seqlens: torch.Tensor, num_sms: int,
                               block_kv: int = 64) -> torch.Tensor:
    """``[num_sms + 1, 2]`` int32: SM ``i`` starts at global block
    ``g_i = i * (total // num_sms) + min(i, total % num_sms)``, given as (row, block in row) with
    zero-length rows skipped; ``(R, 0)`` once every block is handed out. Negative lengths count
    as 0.
    """
    blocks = [-(-max(int(length), 0) // block_kv) for length in seqlens.tolist()]
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


def schedule_shares(schedule: torch.Tensor, seqlens: torch.Tensor,
                    block_kv: int = 64) -> list[list[tuple[int, int]]]:
    """The (row, block) pairs each SM walks under ``schedule``: from ``schedule[i]`` up to, not
    including, ``schedule[i + 1]``, row-major, over the live blocks of ``seqlens``."""
    blocks = [-(-max(int(length), 0) // block_kv) for length in seqlens.tolist()]
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
