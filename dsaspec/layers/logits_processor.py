"""LogitsProcessor: next-token logits by gathering the vocab shards, or, for greedy drafts, top-k drafts and
greedy target verify, tokens (and probabilities) by exchanging vocab-shard partials (docs/argmax-exchange.md).

Gather path: local GEMM → all-gather → slice to ``vocab_size`` → fp32 → optional final-logit softcap.
Exchange paths (processors that opted in): local GEMM → partials → one fp32 SUM all-reduce → finalize; no
logits leave the rank and ``next_token_logits`` is None. Greedy drafts (topk 1) and target verify exchange
argmax partials; top-k drafts (``1 < topk <= max_topk``) exchange top-k partials with probability lanes.

The choice is made from TP-replicated facts only (sampling, head layout, config, transport, options), so
every rank takes the same branch; it fails closed to the gather path. The options are fixed when the
processor is built: a captured CUDA graph keeps the branch it was captured with, so a processor never
changes branch behind a graph's back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsaspec.distributed.tp_group import LOCAL, NCCL, TPGroup
from dsaspec.ops.argmax_exchange import (
    DEFAULT_SPLIT_COLUMNS,
    LANES,
    TOPK_MAX,
    TOPK_SPLIT_COLUMNS,
    argmax_partials,
    draft_finalize,
    exchange_layout,
    topk_finalize,
    topk_partials,
    topk_slot_lanes,
)
from dsaspec.layers.vocab_parallel import VocabParallelLMHead


@dataclass(frozen=True)
class DraftSampling:
    """How a draft step picks tokens (TP-replicated): ``topk`` candidates, greedy or not."""

    topk: int = 1
    greedy: bool = True


GREEDY_TOPK1 = DraftSampling(topk=1, greedy=True)


@dataclass
class LogitsProcessorOutput:
    """What the LogitsProcessor hands on.

    Gather path: ``next_token_logits`` ``[rows, vocab_size]`` fp32, the rest None.
    Greedy (topk 1) exchange: ``next_token_logits`` is None; ``next_token_argmax_partials`` ``[rows, TP *
    splits, 4]`` fp32 (the all-reduced candidates), ``next_token_ids`` ``[rows]`` int64, ``topk_p``
    ``[rows]`` fp32 (1.0) and, when positions were given, ``positions`` ``[rows]`` (positions + 1).
    Top-k exchange: ``next_token_logits`` is None; ``next_token_topk_partials`` ``[rows, TP * splits,
    4 * topk + 1]`` fp32, ``topk_index`` ``[rows, topk]`` int64 and ``topk_p`` ``[rows, topk]`` fp32 (softmax
    probabilities, best first; see ``topk_finalize``).
    Tensors are views of the processor's static buffers, valid until its next forward.
    """

    next_token_logits: torch.Tensor | None = None
    next_token_argmax_partials: torch.Tensor | None = None
    next_token_topk_partials: torch.Tensor | None = None
    next_token_ids: torch.Tensor | None = None
    topk_index: torch.Tensor | None = None
    topk_p: torch.Tensor | None = None
    positions: torch.Tensor | None = None


def exchange_argmax_partials(
    group: TPGroup,
    local_logits: torch.Tensor,
    *,
    vocab_size: int,
    exchange: torch.Tensor,
    reduced: torch.Tensor,
    split_columns: int = DEFAULT_SPLIT_COLUMNS,
) -> torch.Tensor:
    """Partials of this rank's shard, then one fp32 SUM all-reduce over ``group``.

    Parameters
    ----------
    group : TPGroup the head is sharded over (any transport).
    local_logits : Tensor ``[rows, Sh]`` bf16/fp32; this rank's local logits.
    exchange : Tensor ``[rows, TP * splits, 4]`` fp32, contiguous; written with the partials (ideally
        from ``group.symmetric_empty`` so the all-reduce reads it in place).
    reduced : Tensor like ``exchange``, written with the sum (ignored at TP 1 and on NCCL, where the
        sum is taken in place in ``exchange``).

    Returns
    -------
    The all-reduced buffer ``[rows, TP * splits, 4]`` fp32 (``reduced`` or ``exchange``).
    """
    argmax_partials(local_logits, exchange, rank=group.rank, tp_size=group.size, vocab_size=vocab_size,
                    split_columns=split_columns)
    return _sum_over_ranks(group, exchange, reduced)


def exchange_topk_partials(
    group: TPGroup,
    local_logits: torch.Tensor,
    *,
    k: int,
    vocab_size: int,
    exchange: torch.Tensor,
    reduced: torch.Tensor,
    split_columns: int = TOPK_SPLIT_COLUMNS,
) -> torch.Tensor:
    """Top-``k`` partials (with the sums of exponentials) of this rank's shard, then one fp32 SUM all-reduce.

    Parameters as ``exchange_argmax_partials``, with ``exchange`` / ``reduced`` of shape ``[rows, TP * splits,
    4 * k + 1]`` (``topk_slot_lanes(k)``) and ``1 <= k <= TOPK_MAX``.

    Returns
    -------
    The all-reduced buffer ``[rows, TP * splits, 4 * k + 1]`` fp32 (``reduced`` or ``exchange``).
    """
    topk_partials(local_logits, exchange, k=k, rank=group.rank, tp_size=group.size, vocab_size=vocab_size,
                  split_columns=split_columns)
    return _sum_over_ranks(group, exchange, reduced)


def _sum_over_ranks(group: TPGroup, exchange: torch.Tensor, reduced: torch.Tensor) -> torch.Tensor:
    transport = group.all_reduce_transport(exchange.numel() * 4)
    if transport == LOCAL:
        return exchange
    if transport == NCCL:
        return group.all_reduce(exchange)
    return group.all_reduce(exchange, out=reduced)


class LogitsProcessor:
    """Next-token logits (gather), or draft tokens, top-k draft probabilities and greedy target tokens
    (exchanges) from hidden states.

    Parameters
    ----------
    lm_head : VocabParallelLMHead (vocab-parallel or replicated) over its ``group``.
    final_logit_softcapping : optional float ``cap``; the gather path applies ``cap * tanh(x / cap)``.
    dp_attention : bool; rows are gathered across DP ranks (the exchange does not apply).
    max_rows : int; largest row count of a forward or ``target_tokens`` (the static buffers' size): at least
        the batch size for drafts and ``bs * N`` (N tokens per request) for target verify.
    split_columns : int; target columns per program of the argmax partials kernel.
    topk_split_columns : int; target columns per program of the top-k partials kernel.
    draft_argmax_exchange, verify_argmax_exchange : bool; the exchanges may be taken for greedy drafts /
        target verify (``RuntimeOptions``' fields of these names); False keeps the logits gather.
    """

    def __init__(self, lm_head: VocabParallelLMHead, *, final_logit_softcapping: float | None = None,
                 dp_attention: bool = False, max_rows: int = 64, split_columns: int = DEFAULT_SPLIT_COLUMNS,
                 topk_split_columns: int = TOPK_SPLIT_COLUMNS, draft_argmax_exchange: bool = True,
                 verify_argmax_exchange: bool = True):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        if not 1 <= topk_split_columns <= TOPK_SPLIT_COLUMNS:
            raise ValueError(f"topk_split_columns must be in [1, TOPK_SPLIT_COLUMNS={TOPK_SPLIT_COLUMNS}], got "
                             f"{topk_split_columns}")
        self.lm_head = lm_head
        self.group = lm_head.group
        self.vocab_size = lm_head.vocab_size
        self.final_logit_softcapping = final_logit_softcapping
        self.dp_attention = dp_attention
        self.max_rows = max_rows
        self.split_columns = split_columns
        self.topk_split_columns = topk_split_columns
        self._draft_switch_on = bool(draft_argmax_exchange)
        self._verify_switch_on = bool(verify_argmax_exchange)
        device, dtype = self.group.device, lm_head.weight.dtype
        shard, shards = lm_head.shard_size, lm_head.num_shards
        self._local = torch.empty(max_rows * shard, dtype=dtype, device=device)
        self._gathered = torch.empty(max_rows * shard * shards, dtype=dtype, device=device) if shards > 1 else None
        self._logits = torch.empty(max_rows * shard * shards, dtype=torch.float32, device=device)
        self._argmax = torch.empty(max_rows, dtype=torch.int64, device=device)
        self._tokens = torch.empty(max_rows, dtype=torch.int64, device=device)
        self._topk_p = torch.empty(max_rows, dtype=torch.float32, device=device)
        self._positions = torch.empty(max_rows, dtype=torch.int64, device=device)
        self._target_tokens = torch.empty(max_rows, dtype=torch.int64, device=device)
        self._topk_probs = torch.empty(max_rows * TOPK_MAX, dtype=torch.float32, device=device)
        self._topk_index = torch.empty(max_rows * TOPK_MAX, dtype=torch.int64, device=device)
        self._slots = self.group.size * exchange_layout(shard, split_columns)[0]
        self._topk_slots = self.group.size * exchange_layout(shard, topk_split_columns)[0]
        self._exchange = None
        self._reduced = None
        self._topk_exchange = None
        self._topk_reduced = None
        self._draft_opted_in = False
        self._verify_opted_in = False
        self.max_topk = 1

    # -- opting in (collective, eager, before any capture) --------------------------------------------

    def enable_draft_argmax_exchange(self, *, max_topk: int = 1) -> None:
        """Opt in to the exchange for greedy draft forwards with ``topk <= max_topk``.

        ``topk == 1`` exchanges argmax partials; ``1 < topk <= max_topk`` top-k partials with probability
        lanes (``1 <= max_topk <= min(TOPK_MAX, vocab_size)``). Allocates the exchange buffers (symmetric
        memory when the group uses it): collective over the TP group; call it on every rank, in the same
        order, eagerly, before any CUDA-graph capture. Calling it again with a larger ``max_topk`` grows
        the top-k buffer (collective again).
        """
        if not 1 <= max_topk <= min(TOPK_MAX, self.vocab_size):
            raise ValueError(f"max_topk must be in [1, min(TOPK_MAX={TOPK_MAX}, vocab_size={self.vocab_size})], "
                             f"got {max_topk}")
        self._allocate_argmax_exchange()
        self._draft_opted_in = True
        if max_topk > self.max_topk:
            numel = self.max_rows * self._topk_slots * topk_slot_lanes(max_topk)
            self._topk_exchange = self.group.symmetric_empty(numel, torch.float32)
            self._topk_reduced = torch.empty(numel, dtype=torch.float32, device=self.group.device)
            self.max_topk = max_topk

    def enable_verify_argmax_exchange(self) -> None:
        """Opt in to the argmax exchange for ``target_tokens`` (greedy target verify).

        Shares the argmax exchange buffer with greedy drafts (allocated on first opt-in): collective over
        the TP group; call it on every rank, in the same order, eagerly, before any CUDA-graph capture.
        """
        self._allocate_argmax_exchange()
        self._verify_opted_in = True

    def _allocate_argmax_exchange(self) -> None:
        if self._exchange is not None:
            return
        numel = self.max_rows * self._slots * LANES
        self._exchange = self.group.symmetric_empty(numel, torch.float32)
        self._reduced = torch.empty(numel, dtype=torch.float32, device=self.group.device)

    @property
    def exchange_nbytes(self) -> int:
        """Bytes of the largest argmax exchange all-reduce (``max_rows * TP * splits * 16``)."""
        return self.max_rows * self._slots * LANES * 4

    def topk_exchange_nbytes(self, topk: int) -> int:
        """Bytes of the largest top-``topk`` exchange all-reduce (``max_rows * TP * splits * (4 * topk + 1) * 4``)."""
        return self.max_rows * self._topk_slots * topk_slot_lanes(topk) * 4

    # -- decisions (TP-replicated facts only, so every rank agrees) -----------------------------------

    def draft_argmax_exchange_declined(self, sampling: DraftSampling | None) -> str | None:
        """Why a forward with ``sampling`` gathers logits instead of exchanging partials; None if it exchanges."""
        if not self._draft_opted_in:
            return "the processor did not opt in (enable_draft_argmax_exchange)"
        if sampling is None or not sampling.greedy:
            return "not a greedy draft"
        if not 1 <= sampling.topk <= self.max_topk:
            return f"topk is {sampling.topk}, not in [1, max_topk={self.max_topk}] (enable_draft_argmax_exchange)"
        nbytes = self.exchange_nbytes if sampling.topk == 1 else self.topk_exchange_nbytes(sampling.topk)
        return self._exchange_declined(nbytes, self._draft_switch_on, "draft_argmax_exchange")

    def uses_draft_argmax_exchange(self, sampling: DraftSampling | None) -> bool:
        """True when a forward with ``sampling`` takes an exchange path."""
        return self.draft_argmax_exchange_declined(sampling) is None

    def verify_argmax_exchange_declined(self) -> str | None:
        """Why ``target_tokens`` gathers logits instead of exchanging argmax partials; None if it exchanges."""
        if not self._verify_opted_in:
            return "the processor did not opt in (enable_verify_argmax_exchange)"
        return self._exchange_declined(self.exchange_nbytes, self._verify_switch_on, "verify_argmax_exchange")

    def uses_verify_argmax_exchange(self) -> bool:
        """True when ``target_tokens`` takes the exchange path."""
        return self.verify_argmax_exchange_declined() is None

    def _exchange_declined(self, nbytes: int, switch_on: bool, option: str) -> str | None:
        if not self.lm_head.vocab_parallel:
            return "the LM head is replicated"
        if self.final_logit_softcapping:
            return "final-logit softcapping"
        if self.dp_attention:
            return "DP attention"
        if self.group.all_reduce_transport(nbytes) == NCCL:
            return "the all-reduce would run on NCCL"
        if not switch_on:
            return f"{option}=False (the processor's option)"
        return None

    # -- forwards -----------------------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor, sampling: DraftSampling | None = None, *,
                positions: torch.Tensor | None = None,
                token_map: torch.Tensor | None = None) -> LogitsProcessorOutput:
        """Logits (gather path), greedy draft tokens or top-k draft probabilities (exchange paths).

        Parameters
        ----------
        hidden_states : Tensor ``[rows, hidden]``, the head's dtype; ``rows <= max_rows``.
        sampling : DraftSampling of a draft forward, or None (target / non-draft: always gather).
        positions : optional Tensor ``[rows]`` int64; on the greedy exchange path ``positions + 1`` is written.
        token_map : optional Tensor ``[vocab_size]`` int32/int64; on the greedy exchange path tokens are mapped
            through it. Neither applies to ``topk > 1`` (passing one raises).

        Arguments are validated on the host (no device sync), on every call: inside a captured CUDA
        graph that happens once, at capture.

        Returns
        -------
        LogitsProcessorOutput (see its docstring); writes the processor's static buffers only.
        """
        rows = self._check_rows(hidden_states)
        if positions is not None and (tuple(positions.shape) != (rows,) or positions.dtype != torch.int64):
            raise ValueError(f"positions must be int64 [{rows}], got {tuple(positions.shape)} {positions.dtype}")
        if token_map is not None and tuple(token_map.shape) != (self.vocab_size,):
            # draft_finalize's token_map load is unmasked: one entry per vocab token keeps it in bounds.
            raise ValueError(f"token_map must be [vocab_size={self.vocab_size}], got {tuple(token_map.shape)}")
        topk = 1 if sampling is None else sampling.topk
        if topk > 1 and (positions is not None or token_map is not None):
            raise ValueError(f"positions and token_map apply to topk = 1 drafts only, got topk={topk}")
        local = self._local_logits(hidden_states)
        if not self.uses_draft_argmax_exchange(sampling):
            return LogitsProcessorOutput(next_token_logits=self._gather_logits(local))
        if topk > 1:
            lanes = topk_slot_lanes(topk)
            view = slice(0, rows * self._topk_slots * lanes)
            reduced = exchange_topk_partials(
                self.group, local, k=topk, vocab_size=self.vocab_size,
                exchange=self._topk_exchange[view].view(rows, self._topk_slots, lanes),
                reduced=self._topk_reduced[view].view(rows, self._topk_slots, lanes),
                split_columns=self.topk_split_columns)
            topk_p, topk_index = self.topk_outputs(rows, topk)
            topk_finalize(reduced, k=topk, topk_index=topk_index, topk_p=topk_p)
            return LogitsProcessorOutput(next_token_topk_partials=reduced, topk_index=topk_index, topk_p=topk_p)
        reduced = self._argmax_exchange(local)
        tokens, topk_p = self._tokens[:rows], self._topk_p[:rows]
        positions_out = None if positions is None else self._positions[:rows]
        draft_finalize(tokens=tokens, topk_p=topk_p, positions=positions, positions_out=positions_out,
                       reduced=reduced, token_map=token_map)
        return LogitsProcessorOutput(next_token_argmax_partials=reduced, next_token_ids=tokens, topk_p=topk_p,
                                     positions=positions_out)

    __call__ = forward

    def target_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Greedy target-verify tokens: ``torch.argmax`` of the gathered fp32 logits of every row.

        On the exchange path (``uses_verify_argmax_exchange()``): argmax partials, one SUM all-reduce and the
        finalize, bit-identical to ``torch.argmax`` of the gathered fp32 logits (lowest index among equal
        maxima, NaN above everything, -0 == +0; docs/argmax-exchange.md). Otherwise the gather path and
        ``torch.argmax`` (softcap applied). Graph-safe: static buffers, no host sync. For greedy acceptance
        only: sampling, grammar masks or logit processors need the logits (``forward(hidden_states)``).

        Parameters
        ----------
        hidden_states : Tensor ``[rows, hidden]``, the head's dtype; ``rows <= max_rows`` (``bs * N`` rows
            for N verify tokens per request).

        Arguments are validated on the host (no device sync); inside a captured graph, once, at capture.

        Returns
        -------
        Tensor ``[rows]`` int64, a view of a static buffer, valid until the next ``target_tokens``.
        """
        rows = self._check_rows(hidden_states)
        tokens = self._target_tokens[:rows]
        if rows == 0:
            return tokens
        local = self._local_logits(hidden_states)
        if self.uses_verify_argmax_exchange():
            draft_finalize(tokens=tokens, reduced=self._argmax_exchange(local))
        else:
            torch.argmax(self._gather_logits(local), dim=-1, out=tokens)
        return tokens

    def _check_rows(self, hidden_states: torch.Tensor) -> int:
        rows = hidden_states.shape[0]
        if rows > self.max_rows:
            raise ValueError(f"hidden_states has {rows} rows, above max_rows={self.max_rows}")
        return rows

    def _local_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        rows, shard = hidden_states.shape[0], self.lm_head.shard_size
        return self.lm_head(hidden_states, out=self._local[:rows * shard].view(rows, shard))

    def _argmax_exchange(self, local: torch.Tensor) -> torch.Tensor:
        view = slice(0, local.shape[0] * self._slots * LANES)
        return exchange_argmax_partials(
            self.group, local, vocab_size=self.vocab_size,
            exchange=self._exchange[view].view(-1, self._slots, LANES),
            reduced=self._reduced[view].view(-1, self._slots, LANES),
            split_columns=self.split_columns)

    def _gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        rows, shard = local.shape
        shards = self.lm_head.num_shards
        gathered = None if shards == 1 else self._gathered[:shards * rows * shard].view(shards, rows, shard)
        logits = self.lm_head.gather_logits(local, gathered=gathered,
                                            out=self._logits[:rows * shards * shard].view(rows, shards * shard))
        if self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    def draft_outputs(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Static ``[rows]`` views (argmax scratch int64, tokens int64, topk_p fp32, positions int64)."""
        return self._argmax[:rows], self._tokens[:rows], self._topk_p[:rows], self._positions[:rows]

    def topk_outputs(self, rows: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Static ``[rows, topk]`` views (topk_p fp32, topk_index int64) of a top-k draft forward."""
        if not 1 <= topk <= TOPK_MAX:
            raise ValueError(f"topk must be in [1, TOPK_MAX={TOPK_MAX}], got {topk}")
        n = rows * topk
        return self._topk_probs[:n].view(rows, topk), self._topk_index[:n].view(rows, topk)
