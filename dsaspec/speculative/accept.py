"""Greedy acceptance of a verified draft chain (EAGLE / MTP, ``topk = 1``), as one graph-safe
tensor function.

A request verified ``N = S + 1`` rows: its pending bonus token and drafts ``d_1 .. d_S``. Row
``j``'s target argmax ``t_j`` is the target's own choice for the position after row ``j``. The
drafts are accepted while ``d_{j+1} == t_j``; the target's choice at the first mismatch (or after
the last draft) is the new bonus. With ``k`` accepted drafts the request commits ``A = k + 1``
tokens, ``[d_1 .. d_k, t_k]``, which are exactly the tokens greedy decoding without drafts
produces, because each accepted draft equals the target's argmax at its position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsaspec.ops.checks import check_tensor


@dataclass
class Acceptance:
    """What :func:`greedy_accept` writes, all int64 on the inputs' device.

    Attributes
    ----------
    accept_len : ``[B]``, ``A = k + 1`` (accepted drafts plus the bonus), in ``[1, N]``.
    committed : ``[B, N]``, row ``b``'s ``A`` committed tokens ``[d_1 .. d_k, t_k]`` first, then 0
        (this is also the draft extend's input ids).
    bonus : ``[B]``, the new pending token ``t_k`` (``committed[b, A - 1]``).
    """

    accept_len: torch.Tensor
    committed: torch.Tensor
    bonus: torch.Tensor


def greedy_accept(drafts: torch.Tensor, target_tokens: torch.Tensor, *,
                  forced_accept_len: torch.Tensor | None = None,
                  out: Acceptance | None = None) -> Acceptance:
    """Accept the longest draft prefix that matches the target's argmax, plus the target's bonus.

    ``k[b] = max { i : d[b, j] == t[b, j] for all j < i }`` (``0 <= k <= S``), ``A = k + 1``,
    ``committed[b, j] = d[b, j]`` for ``j < k``, ``t[b, k]`` at ``j = k``, 0 after;
    ``bonus = t[b, k]``. With ``forced_accept_len`` = ``a > 0`` every request takes
    ``k = min(a, N) - 1`` instead (simulated acceptance: the first ``k`` drafts are committed as if
    they had matched, then the target's token at row ``k``); ``a = 0`` keeps the real ``k``.

    Parameters
    ----------
    drafts : int64 ``[B, S]``, the drafts ``d_1 .. d_S`` (verify rows ``1 .. S``).
    target_tokens : int64 ``[B, N]``, ``N = S + 1``: the target's argmax of each verify row.
    forced_accept_len : optional int64 ``[1]`` device tensor (read on the device: no host sync).
    out : optional :class:`Acceptance` of static buffers (``[>= B]`` / ``[>= B, N]``) to write.

    Returns
    -------
    :class:`Acceptance` (``out``'s leading ``B`` rows when given). No host sync; graph-safe. Every
    argument's dtype, shape and device is checked (on the host) before anything is written: a
    ``ValueError`` (``TypeError`` for a non-tensor) names the argument.
    """
    batch, steps = _check_arguments(drafts, target_tokens, forced_accept_len, out)
    rows = steps + 1
    matched = (drafts == target_tokens[:, :steps]).long().cumprod(dim=1).sum(dim=1)
    if forced_accept_len is not None:
        forced = (forced_accept_len.clamp(max=rows) - 1).expand(batch)
        matched = torch.where(forced_accept_len > 0, forced, matched)
    columns = torch.arange(rows, device=drafts.device)
    drafts_padded = torch.cat((drafts, drafts.new_zeros(batch, 1)), dim=1)
    at_bonus = columns[None, :] == matched[:, None]
    committed = torch.where(columns[None, :] < matched[:, None], drafts_padded,
                            torch.where(at_bonus, target_tokens, 0))
    bonus = target_tokens.gather(1, matched[:, None]).squeeze(1)
    if out is None:
        return Acceptance(matched + 1, committed, bonus)
    torch.add(matched, 1, out=out.accept_len[:batch])
    out.committed[:batch].copy_(committed)
    out.bonus[:batch].copy_(bonus)
    return Acceptance(out.accept_len[:batch], out.committed[:batch], out.bonus[:batch])


def _check_arguments(drafts, target_tokens, forced_accept_len, out) -> tuple[int, int]:
    """Host-side checks of :func:`greedy_accept`'s arguments; returns ``(B, S)``."""
    check_tensor("drafts", drafts, dtype=torch.int64, ndim=2, contiguous_last=False)
    batch, steps = drafts.shape
    device = drafts.device
    check_tensor("target_tokens", target_tokens, dtype=torch.int64, ndim=2, device=device,
                 contiguous_last=False)
    if target_tokens.shape != (batch, steps + 1):
        raise ValueError(f"target_tokens: expected shape ({batch}, {steps + 1}) (one more column "
                         f"than drafts), got {tuple(target_tokens.shape)}")
    if forced_accept_len is not None:
        check_tensor("forced_accept_len", forced_accept_len, dtype=torch.int64, shape=(1,),
                     device=device)
    if out is not None:
        for name, shape in (("accept_len", (None,)), ("committed", (None, steps + 1)),
                            ("bonus", (None,))):
            tensor = getattr(out, name)
            check_tensor(f"out.{name}", tensor, dtype=torch.int64, shape=shape, device=device,
                         contiguous_last=False)
            if tensor.shape[0] < batch:
                raise ValueError(f"out.{name}: expected at least {batch} rows (one per request), "
                                 f"got shape {tuple(tensor.shape)}")
    return batch, steps
