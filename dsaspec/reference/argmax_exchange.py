"""Pure-PyTorch definition of the vocab-shard argmax exchange (docs/argmax-exchange.md).

A greedy draft step over a vocab-parallel LM head needs ``torch.argmax`` of the gathered fp32 logits
``L = cat(shard_0[:, :n_0], ..., shard_{TP-1}[:, :n_{TP-1}])``. Instead of gathering ``L``, every
rank reduces its valid shard columns to one candidate per split, written as 4 exact fp32 lanes
``(key >> 16, key & 0xFFFF, index >> 16, index & 0xFFFF)`` into its slots of a
``[rows, TP * splits, 4]`` buffer (+0.0 in every other slot); a SUM all-reduce of that buffer hands
every rank every candidate exactly; the finalize takes the largest key, lowest global index on ties.

``key`` is an order-preserving uint32 of the fp32 value: NaN (any sign or payload) → 0xFFFFFFFF,
-0 → +0, otherwise ``bits | 0x80000000`` for non-negative and ``~bits`` for negative values. Its
smallest real value is KEY(-inf) = 0x007FFFFF, so lane 0 of a real candidate is >= 127 and a lane 0
of 0 marks an empty slot.

The top-k exchange sends each split's ``k`` best candidates (same lanes) and its sum of
``exp(x - max)``; its finalize takes the ``k`` best candidates of the row (largest key first, lowest
index among equal keys: ``torch.sort(descending=True, stable=True)``) and their softmax probabilities.
"""

from __future__ import annotations

import torch

KEY_NAN = 0xFFFFFFFF
KEY_ZERO = 0x80000000
KEY_NEG_INF = 0x007FFFFF
LANES = 4


def order_key_nan_max_zeros_equal(values: torch.Tensor) -> torch.Tensor:
    """Order-preserving uint32 key of fp32 values, as int64: ``a < b ⇔ key(a) < key(b)``; every NaN
    is above +inf (one key for all NaNs) and -0 equals +0 (``torch.argmax``'s order).

    Parameters
    ----------
    values : Tensor, any shape, fp32 (bf16/fp16 are widened exactly first).

    Returns
    -------
    Tensor, same shape, int64 in [0, 2**32): NaN → 0xFFFFFFFF, ±0 → 0x80000000, else the sign-flip key.
    """
    bits = values.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    magnitude = bits & 0x7FFFFFFF
    bits = torch.where(magnitude == 0, torch.zeros_like(bits), bits)
    key = torch.where(bits >= 0x80000000, (~bits) & 0xFFFFFFFF, bits | 0x80000000)
    return torch.where(magnitude > 0x7F800000, torch.full_like(key, KEY_NAN), key)


def argmax_partials_reference(
    local_logits: torch.Tensor,
    *,
    rank: int,
    tp_size: int,
    vocab_size: int,
    split_width: int,
    foreign_fill: float = 0.0,
) -> torch.Tensor:
    """One rank's exchange buffer: its candidates in its slots, ``foreign_fill`` everywhere else.

    Rank ``r`` owns global columns ``[r * Sh, r * Sh + n_valid)`` with
    ``n_valid = clamp(vocab_size - r * Sh, 0, Sh)``; split ``s`` reduces local columns
    ``[s * split_width, min((s + 1) * split_width, n_valid))`` to (max key, first index of it).

    Parameters
    ----------
    local_logits : Tensor ``[rows, Sh]``, bf16 or fp32; this rank's shard (padding columns ignored).
    rank, tp_size, vocab_size : int; ``tp_size * Sh >= vocab_size``.
    split_width : int; columns per split, ``splits = ceil(Sh / split_width)``.
    foreign_fill : float; value of the slots of other ranks (+0.0; -0.0 emulates a sign-rewriting
        transport).

    Returns
    -------
    Tensor ``[rows, tp_size * splits, 4]`` fp32; an empty split (no valid column) has four zeros.
    """
    rows, shard = local_logits.shape
    splits = -(-shard // split_width)
    out = torch.full((rows, tp_size * splits, LANES), foreign_fill, dtype=torch.float32)
    out[:, rank * splits:(rank + 1) * splits] = 0.0
    n_valid = max(0, min(vocab_size - rank * shard, shard))
    keys = order_key_nan_max_zeros_equal(local_logits[:, :n_valid].cpu())
    for s in range(splits):
        lo, hi = s * split_width, min((s + 1) * split_width, n_valid)
        if lo >= hi:
            continue
        best = keys[:, lo:hi].max(dim=1).values
        first = (keys[:, lo:hi] == best[:, None]).to(torch.int64).argmax(dim=1)
        index = rank * shard + lo + first
        lanes = torch.stack([best >> 16, best & 0xFFFF, index >> 16, index & 0xFFFF], dim=1)
        out[:, rank * splits + s] = lanes.to(torch.float32)
    return out.to(local_logits.device)


def argmax_finalize_reference(
    reduced: torch.Tensor,
    positions: torch.Tensor | None = None,
    token_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens from the all-reduced exchange buffer: largest key, lowest global index on ties.

    Parameters
    ----------
    reduced : Tensor ``[rows, slots, 4]`` fp32; sum of every rank's buffer (lanes exact integers).
    positions : optional Tensor ``[rows]`` int32/int64.
    token_map : optional Tensor ``[vocab]`` int; draft-vocab → target-vocab map applied to the token.

    Returns
    -------
    tokens ``[rows]`` int64, topk_p ``[rows]`` fp32 (all 1.0), positions + 1 ``[rows]`` (None without
    positions).
    """
    lanes = reduced.cpu().to(torch.int64)
    key = torch.where(lanes[..., 0] > 0, lanes[..., 0] * 65536 + lanes[..., 1], torch.full_like(lanes[..., 0], -1))
    index = lanes[..., 2] * 65536 + lanes[..., 3]
    best = key.max(dim=1, keepdim=True).values
    tokens = torch.where(key == best, index, torch.full_like(index, 2**62)).min(dim=1).values
    tokens = tokens.to(reduced.device)
    if token_map is not None:
        tokens = token_map.to(torch.int64)[tokens]
    topk_p = torch.ones(tokens.shape, dtype=torch.float32, device=reduced.device)
    return tokens, topk_p, None if positions is None else positions + 1


def gathered_logits_reference(
    shards: list[torch.Tensor], vocab_size: int, final_logit_softcapping: float | None = None
) -> torch.Tensor:
    """The gathered path's next-token logits: ``post(cat(shards, -1)[:, :vocab_size])``.

    ``post`` widens to fp32 and, if configured, applies ``cap * tanh(x / cap)``.

    Parameters
    ----------
    shards : list of Tensor ``[rows, Sh]`` (rank order), bf16 or fp32.

    Returns
    -------
    Tensor ``[rows, vocab_size]`` fp32.
    """
    logits = torch.cat(shards, dim=-1)[:, :vocab_size].float()
    if final_logit_softcapping:
        logits = torch.tanh(logits / final_logit_softcapping) * final_logit_softcapping
    return logits


def gathered_argmax_reference(shards: list[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """Draft tokens of the gathered path: ``torch.argmax`` over the gathered fp32 logits.

    Returns
    -------
    Tensor ``[rows]`` int64.
    """
    return torch.argmax(gathered_logits_reference(shards, vocab_size), dim=-1)


# -- top-k exchange with probability lanes ---------------------------------------------------------

def _value_of_key(key: torch.Tensor) -> torch.Tensor:
    """fp32 value of uint32 order keys (int64): the inverse of the order key (±0 → +0, NaN key → NaN)."""
    bits = torch.where(key >= KEY_ZERO, key - KEY_ZERO, 0xFFFFFFFF - key)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def topk_partials_reference(
    local_logits: torch.Tensor,
    *,
    k: int,
    rank: int,
    tp_size: int,
    vocab_size: int,
    split_width: int,
    foreign_fill: float = 0.0,
) -> torch.Tensor:
    """One rank's top-k exchange buffer: per split its ``k`` best candidates, then its sum of exponentials.

    Columns and splits as in ``argmax_partials_reference``. A split's candidates are its columns sorted by
    order key, largest first, lowest index first among equal keys (a stable sort), the first ``k`` of them
    as 4 lanes each (zeros past the split's valid columns); lane ``4k`` is ``sum_c exp(x_c - m)`` over the
    split's valid columns, ``m`` the first candidate's value, computed in float64 and rounded to fp32 (0 if
    ``m`` is NaN or ±inf or the split is empty).

    Returns
    -------
    Tensor ``[rows, tp_size * splits, 4 * k + 1]`` fp32; other ranks' slots hold ``foreign_fill``.
    """
    rows, shard = local_logits.shape
    splits = -(-shard // split_width)
    lanes = 4 * k + 1
    out = torch.full((rows, tp_size * splits, lanes), foreign_fill, dtype=torch.float32)
    out[:, rank * splits:(rank + 1) * splits] = 0.0
    n_valid = max(0, min(vocab_size - rank * shard, shard))
    values = local_logits[:, :n_valid].cpu().float()
    keys = order_key_nan_max_zeros_equal(values)
    for s in range(splits):
        lo, hi = s * split_width, min((s + 1) * split_width, n_valid)
        if lo >= hi:
            continue
        order = torch.sort(keys[:, lo:hi], dim=1, descending=True, stable=True).indices[:, :k]
        best = keys[:, lo:hi].gather(1, order)
        index = rank * shard + lo + order
        lanes_k = torch.stack([best >> 16, best & 0xFFFF, index >> 16, index & 0xFFFF], dim=2).flatten(1)
        slot = out[:, rank * splits + s]
        slot[:, :lanes_k.shape[1]] = lanes_k.to(torch.float32)
        m = _value_of_key(best[:, 0]).double()
        finite = torch.isfinite(m)
        total = torch.exp(values[:, lo:hi].double() - torch.where(finite, m, 0.0)[:, None]).sum(dim=1)
        slot[:, 4 * k] = torch.where(finite, total, 0.0).to(torch.float32)
    return out.to(local_logits.device)


def topk_finalize_reference(reduced: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k tokens, probabilities and log-sum-exp from an all-reduced top-k exchange buffer, in float64.

    Candidates are merged by order key, largest first, lowest vocab index first among equal keys;
    ``M`` = the first one's value, ``S = sum_s exp(m_s - M) * s_s`` over the non-empty slots,
    ``p_j = exp(x_j - M) / S``, ``lse = M + log(S)``; a row whose ``M`` is NaN or ±inf gets ``p = NaN`` and
    ``lse = M``.

    Parameters
    ----------
    reduced : Tensor ``[rows, slots, 4 * k + 1]`` fp32 (lanes 0..4k-1 exact integers).

    Returns
    -------
    topk_index ``[rows, k]`` int64, topk_p ``[rows, k]`` fp32, lse ``[rows]`` fp32.
    """
    lanes = reduced.cpu()
    cand = lanes[..., :4 * k].to(torch.int64).unflatten(-1, (k, 4))
    key = torch.where(cand[..., 0] > 0, cand[..., 0] * 65536 + cand[..., 1], torch.full_like(cand[..., 0], -1))
    index = cand[..., 2] * 65536 + cand[..., 3]
    rows = key.shape[0]
    key, index = key.reshape(rows, -1), index.reshape(rows, -1)
    # Sort by (key descending, index ascending): index ascending first, then a stable sort by key.
    by_index = torch.sort(index, dim=1, stable=True).indices
    key, index = key.gather(1, by_index), index.gather(1, by_index)
    order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :k]
    top_key, topk_index = key.gather(1, order), index.gather(1, order)
    values = _value_of_key(top_key.clamp(min=0)).double()
    m = values[:, :1]
    finite = torch.isfinite(m)
    safe_m = torch.where(finite, m, 0.0)
    first = lanes[..., :2].to(torch.int64)
    split_max = _value_of_key(first[..., 0] * 65536 + first[..., 1]).double()
    present = first[..., 0] > 0
    scale = torch.where(present & finite, torch.exp(split_max - safe_m), 0.0)
    total = (scale * lanes[..., 4 * k].double()).sum(dim=1, keepdim=True)
    p = torch.where(finite, torch.exp(values - safe_m) / total, float("nan"))
    lse = torch.where(finite, safe_m + torch.log(total), m)[:, 0]
    device = reduced.device
    return topk_index.to(device), p.to(torch.float32).to(device), lse.to(torch.float32).to(device)


def stable_topk_reference(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The exchange's top-k order on full logits: largest fp32 value first, every NaN above +inf, -0 == +0,
    lowest index first among equal values (``torch.sort(..., descending=True, stable=True)``).

    Parameters
    ----------
    logits : Tensor ``[rows, V]``, any float dtype (widened to fp32).

    Returns
    -------
    Tensor ``[rows, k]`` int64.
    """
    # sorted on the CPU: CUDA's sort ranks NaNs with the sign bit set below -inf (measured on the
    # H200), the CPU sort ranks every NaN above +inf as the contract says
    order = torch.sort(logits.float().cpu(), dim=-1, descending=True, stable=True).indices[:, :k]
    return order.to(logits.device)
