"""One EAGLE/MTP draft step after the draft model: hidden states → greedy tokens, topk_p, positions
(``greedy_draft_step``, topk = 1) or the top-k tokens and their probabilities (``topk_draft_step``), on an
exchange path when the LogitsProcessor takes it, on the gather path otherwise. Both write the processor's
static buffers, so the whole step can be captured in a CUDA graph."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsaspec.ops.argmax_exchange import TOPK_MAX, draft_finalize
from dsaspec.layers.logits_processor import GREEDY_TOPK1, DraftSampling, LogitsProcessor


@dataclass
class DraftStepOutput:
    """``tokens`` ``[rows]`` int64, ``topk_p`` ``[rows]`` fp32 (1.0), ``positions`` ``[rows]`` int64
    (input positions + 1); views of the processor's static buffers."""

    tokens: torch.Tensor
    topk_p: torch.Tensor
    positions: torch.Tensor


def greedy_draft_step(
    processor: LogitsProcessor,
    hidden_states: torch.Tensor,
    positions: torch.Tensor,
    *,
    token_map: torch.Tensor | None = None,
) -> DraftStepOutput:
    """Greedy draft step: ``token = argmax(gathered fp32 logits)`` (through either path), ``topk_p = 1``,
    ``positions + 1``.

    The exchange path finalizes inside the processor; the gather path takes ``torch.argmax`` of the
    gathered fp32 logits and runs the same finalize bookkeeping. ``topk_p = 1.0`` on both: in a topk = 1
    chain every drafted candidate is kept, so the score orders nothing.

    Parameters
    ----------
    processor : LogitsProcessor (exchange used when it opted in and is eligible for greedy topk = 1).
    hidden_states : Tensor ``[rows, hidden]``, the head's dtype; ``rows <= processor.max_rows``.
    positions : Tensor ``[rows]`` int64.
    token_map : optional Tensor ``[vocab_size]`` int32/int64; maps draft tokens to target tokens.

    Arguments are validated on the host (no device sync); inside a captured graph, once, at capture.

    Returns
    -------
    DraftStepOutput; writes only the processor's static buffers.
    """
    rows = hidden_states.shape[0]
    out = processor.forward(hidden_states, GREEDY_TOPK1, positions=positions, token_map=token_map)
    argmax, tokens, topk_p, positions_out = processor.draft_outputs(rows)
    if out.next_token_logits is None:
        return DraftStepOutput(tokens, topk_p, positions_out)
    torch.argmax(out.next_token_logits, dim=-1, out=argmax)
    draft_finalize(tokens=tokens, topk_p=topk_p, positions=positions, positions_out=positions_out,
                   argmax_tokens=argmax, token_map=token_map)
    return DraftStepOutput(tokens, topk_p, positions_out)


@dataclass
class TopkDraftStepOutput:
    """``topk_p`` ``[rows, topk]`` fp32 (softmax probabilities, best first) and ``topk_index`` ``[rows,
    topk]`` int64 (draft-vocab tokens); views of the processor's static buffers."""

    topk_p: torch.Tensor
    topk_index: torch.Tensor


def topk_draft_step(processor: LogitsProcessor, hidden_states: torch.Tensor, topk: int) -> TopkDraftStepOutput:
    """Top-k draft step: the ``topk`` most likely tokens of each row and their softmax probabilities.

    Exchange path (``processor.uses_draft_argmax_exchange(DraftSampling(topk))``): exact top-k of the
    gathered fp32 logits, largest first, lowest index first among equal values; probabilities within the
    bound of ``topk_finalize``. Gather path: ``torch.topk(torch.softmax(logits))`` (what engines do; its
    order among equal values is unspecified).

    Parameters
    ----------
    processor : LogitsProcessor.
    hidden_states : Tensor ``[rows, hidden]``, the head's dtype; ``rows <= processor.max_rows``.
    topk : int, ``2 <= topk <= TOPK_MAX`` (a topk = 1 chain uses ``greedy_draft_step``).

    Arguments are validated on the host (no device sync); inside a captured graph, once, at capture.

    Returns
    -------
    TopkDraftStepOutput; writes only the processor's static buffers.
    """
    if not 2 <= topk <= TOPK_MAX:
        raise ValueError(f"topk must be in [2, TOPK_MAX={TOPK_MAX}] (a topk = 1 chain uses greedy_draft_step), "
                         f"got {topk}")
    topk_p, topk_index = processor.topk_outputs(hidden_states.shape[0], topk)
    out = processor.forward(hidden_states, DraftSampling(topk=topk))
    if out.next_token_logits is not None:
        torch.topk(torch.softmax(out.next_token_logits, dim=-1), topk, dim=-1, out=(topk_p, topk_index))
    return TopkDraftStepOutput(topk_p, topk_index)
