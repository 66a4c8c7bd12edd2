"""Reference greedy chain acceptance: a walk along each request's chain, one request at a time."""

from __future__ import annotations


def reference_greedy_accept(drafts: list[list[int]], target_tokens: list[list[int]],
                            forced_accept_len: int = 0) -> tuple[list[int], list[list[int]]]:
    """Per request: ``(A, committed)``. Walk the chain from the bonus row: while the next draft is
    the target's choice at the current row, take it and move on; at the first mismatch (or the end)
    take the target's choice. ``forced_accept_len > 0``: take ``min(a, N) - 1`` drafts regardless,
    then the target's choice at the row reached. ``committed`` is padded with 0 to ``N``."""
    accept_lens, committed_rows = [], []
    for drafts_b, target_b in zip(drafts, target_tokens):
        rows = len(target_b)
        committed = []
        row = 0
        while row < len(drafts_b):
            accepted = (row < forced_accept_len - 1) if forced_accept_len > 0 else drafts_b[row] == target_b[row]
            if not accepted:
                break
            committed.append(drafts_b[row])
            row += 1
        committed.append(target_b[row])
        accept_lens.append(len(committed))
        committed_rows.append(committed + [0] * (rows - len(committed)))
    return accept_lens, committed_rows
