"""LogitsProcessor: next-token logits by gathering the vocab shards, or, for greedy drafts, tokens by
exchanging vocab-shard argmax partials (docs/argmax-exchange.md).

Gather path: local GEMM → all-gather → slice to ``vocab_size`` → fp32 → optional final-logit softcap.
Exchange path (greedy topk = 1 drafts of processors that opted in): local GEMM → argmax partials →
one fp32 SUM all-reduce → finalize; no logits leave the rank and ``next_token_logits`` is None.

The choice is made from TP-replicated facts only (sampling, head layout, config, transport, kill
switch), so every rank takes the same branch; it fails closed to the gather path. The kill switch is
read once, when the processor is built: a captured CUDA graph keeps the branch it was captured with,
so a processor never changes branch behind a graph's back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsaspec import flags
from dsaspec.distributed.tp_group import LOCAL, NCCL, TPGroup
from dsaspec.ops.argmax_exchange import DEFAULT_SPLIT_COLUMNS, LANES, argmax_partials, draft_finalize, exchange_layout
from dsaspec.speculative.lm_head import VocabParallelLMHead


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
    Exchange path: ``next_token_logits`` is None; ``next_token_argmax_partials`` ``[rows, TP * splits,
    4]`` fp32 (the all-reduced candidates), ``next_token_ids`` ``[rows]`` int64, ``topk_p`` ``[rows]``
    fp32 (1.0) and, when positions were given, ``positions`` ``[rows]`` (positions + 1).
    Tensors are views of the processor's static buffers, valid until its next forward.
    """

    next_token_logits: torch.Tensor | None = None
    next_token_argmax_partials: torch.Tensor | None = None
    next_token_ids: torch.Tensor | None = None
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
    transport = group.all_reduce_transport(exchange.numel() * 4)
    if transport == LOCAL:
        return exchange
    if transport == NCCL:
        return group.all_reduce(exchange)
    return group.all_reduce(exchange, out=reduced)


class LogitsProcessor:
    """Next-token logits (gather) or greedy draft tokens (argmax exchange) from hidden states.

    Parameters
    ----------
    lm_head : VocabParallelLMHead (vocab-parallel or replicated) over its ``group``.
    final_logit_softcapping : optional float ``cap``; the gather path applies ``cap * tanh(x / cap)``.
    dp_attention : bool; rows are gathered across DP ranks (the exchange does not apply).
    max_rows : int; largest row count of a forward (the static buffers' size).
    split_columns : int; target columns per program of the partials kernel.

    The kill switch ``DSASPEC_SPEC_DRAFT_ARGMAX_EXCHANGE`` is read here, once: changing it later
    affects only processors built afterwards (a captured graph could not follow it anyway).
    """

    def __init__(self, lm_head: VocabParallelLMHead, *, final_logit_softcapping: float | None = None,
                 dp_attention: bool = False, max_rows: int = 64, split_columns: int = DEFAULT_SPLIT_COLUMNS):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.lm_head = lm_head
        self.group = lm_head.group
        self.vocab_size = lm_head.vocab_size
        self.final_logit_softcapping = final_logit_softcapping
        self.dp_attention = dp_attention
        self.max_rows = max_rows
        self.split_columns = split_columns
        self._kill_switch_on = flags.spec_draft_argmax_exchange()
        device, dtype = self.group.device, lm_head.weight.dtype
        shard, shards = lm_head.shard_size, lm_head.num_shards
        self._local = torch.empty(max_rows * shard, dtype=dtype, device=device)
        self._gathered = torch.empty(max_rows * shard * shards, dtype=dtype, device=device) if shards > 1 else None
        self._logits = torch.empty(max_rows * shard * shards, dtype=torch.float32, device=device)
        self._argmax = torch.empty(max_rows, dtype=torch.int64, device=device)
        self._tokens = torch.empty(max_rows, dtype=torch.int64, device=device)
        self._topk_p = torch.empty(max_rows, dtype=torch.float32, device=device)
        self._positions = torch.empty(max_rows, dtype=torch.int64, device=device)
        self._target_ids = torch.empty(max_rows, dtype=torch.int64, device=device)
        self._slots = self.group.size * exchange_layout(shard, split_columns)[0]
        self._exchange = None
        self._reduced = None

    def enable_draft_argmax_exchange(self) -> None:
        """Opt in to the argmax exchange for greedy topk = 1 draft forwards.

        Allocates the exchange buffer (symmetric memory when the group uses it): collective over the
        TP group; call it on every rank, eagerly, before any CUDA-graph capture.
        """
        if self._exchange is not None:
            return
        numel = self.max_rows * self._slots * LANES
        self._exchange = self.group.symmetric_empty(numel, torch.float32)
        self._reduced = torch.empty(numel, dtype=torch.float32, device=self.group.device)

    @property
    def exchange_nbytes(self) -> int:
        """Bytes of the largest exchange all-reduce (``max_rows * TP * splits * 16``)."""
        return self.max_rows * self._slots * LANES * 4

    def draft_argmax_exchange_declined(self, sampling: DraftSampling | None) -> str | None:
        """Why a forward with ``sampling`` gathers logits instead of exchanging partials; None if it exchanges.

        Every input is TP-replicated, so all ranks agree.
        """
        if self._exchange is None:
            return "the processor did not opt in (enable_draft_argmax_exchange)"
        if sampling is None or not sampling.greedy:
            return "not a greedy draft"
        if sampling.topk != 1:
            return f"topk is {sampling.topk}, not 1"
        if not self.lm_head.vocab_parallel:
            return "the LM head is replicated"
        if self.final_logit_softcapping:
            return "final-logit softcapping"
        if self.dp_attention:
            return "DP attention"
        if self.group.all_reduce_transport(self.exchange_nbytes) == NCCL:
            return "the all-reduce would run on NCCL"
        if not self._kill_switch_on:
            return "DSASPEC_SPEC_DRAFT_ARGMAX_EXCHANGE was off when the processor was built"
        return None

    def uses_draft_argmax_exchange(self, sampling: DraftSampling | None) -> bool:
        """True when a forward with ``sampling`` takes the exchange path."""
        return self.draft_argmax_exchange_declined(sampling) is None

    def forward(self, hidden_states: torch.Tensor, sampling: DraftSampling | None = None, *,
                positions: torch.Tensor | None = None,
                token_map: torch.Tensor | None = None) -> LogitsProcessorOutput:
        """Logits (gather path) or greedy draft tokens (exchange path) for ``hidden_states``.

        Parameters
        ----------
        hidden_states : Tensor ``[rows, hidden]``, the head's dtype; ``rows <= max_rows``.
        sampling : DraftSampling of a draft forward, or None (target / non-draft: always gather).
        positions : optional Tensor ``[rows]`` int64; on the exchange path ``positions + 1`` is written.
        token_map : optional Tensor ``[vocab_size]`` int32/int64; on the exchange path tokens are mapped
            through it.

        Arguments are validated on the host (no device sync), on every call: inside a captured CUDA
        graph that happens once, at capture.

        Returns
        -------
        LogitsProcessorOutput (see its docstring); writes the processor's static buffers only.
        """
        rows = hidden_states.shape[0]
        if rows > self.max_rows:
            raise ValueError(f"hidden_states has {rows} rows, above max_rows={self.max_rows}")
        if positions is not None and (tuple(positions.shape) != (rows,) or positions.dtype != torch.int64):
            raise ValueError(f"positions must be int64 [{rows}], got {tuple(positions.shape)} {positions.dtype}")
        if token_map is not None and tuple(token_map.shape) != (self.vocab_size,):
            # draft_finalize's token_map load is unmasked: one entry per vocab token keeps it in bounds.
            raise ValueError(f"token_map must be [vocab_size={self.vocab_size}], got {tuple(token_map.shape)}")
        shard = self.lm_head.shard_size
        local = self.lm_head(hidden_states, out=self._local[:rows * shard].view(rows, shard))
        if not self.uses_draft_argmax_exchange(sampling):
            return LogitsProcessorOutput(next_token_logits=self._gather_logits(local))
        view = slice(0, rows * self._slots * LANES)
        reduced = exchange_argmax_partials(
            self.group, local, vocab_size=self.vocab_size,
            exchange=self._exchange[view].view(rows, self._slots, LANES),
            reduced=self._reduced[view].view(rows, self._slots, LANES),
            split_columns=self.split_columns)
        tokens, topk_p = self._tokens[:rows], self._topk_p[:rows]
        positions_out = None if positions is None else self._positions[:rows]
        draft_finalize(tokens=tokens, topk_p=topk_p, positions=positions, positions_out=positions_out,
                       reduced=reduced, token_map=token_map)
        return LogitsProcessorOutput(next_token_argmax_partials=reduced, next_token_ids=tokens, topk_p=topk_p,
                                     positions=positions_out)

    __call__ = forward

    def _gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        rows, shard = local.shape
        shards = self.lm_head.num_shards
        if shards > 1:
            gathered = self.group.all_gather(local, out=self._gathered[:shards * rows * shard].view(shards, rows, shard))
        else:
            gathered = local.unsqueeze(0)
        full = self._logits[:rows * shards * shard].view(rows, shards, shard)
        full.copy_(gathered.transpose(0, 1))  # rank-major → row-major, widened to fp32, in one copy
        logits = full.view(rows, shards * shard)[:, :self.vocab_size]
        if self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    def target_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Greedy target token of each row: ``torch.argmax`` of the gathered fp32 logits (the first
        maximum), for target verify and the prefill's first token.

        Parameters
        ----------
        hidden_states : Tensor ``[rows, hidden]``, the head's dtype; ``rows <= max_rows``.

        Returns
        -------
        Tensor ``[rows]`` int64, a view of a static buffer (valid until the next call); no host
        sync, so it can be captured in a CUDA graph.
        """
        logits = self.forward(hidden_states).next_token_logits
        return torch.argmax(logits, dim=-1, out=self._target_ids[:hidden_states.shape[0]])

    def draft_outputs(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Static ``[rows]`` views (argmax scratch int64, tokens int64, topk_p fp32, positions int64)."""
        return self._argmax[:rows], self._tokens[:rows], self._topk_p[:rows], self._positions[:rows]
