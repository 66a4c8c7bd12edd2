"""The vocab-parallel embedding and LM head: each rank holds a contiguous slice of the padded vocab
(replicated at TP 1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsaspec.distributed.tp_group import TPGroup
from dsaspec.layers.linear import Shard
from dsaspec.layers.row_invariant import RowInvariant, row_invariant_ops

VOCAB_PAD_MULTIPLE = 64


def padded_vocab_size(vocab_size: int, tp_size: int, multiple: int = VOCAB_PAD_MULTIPLE) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple * tp_size``."""
    if vocab_size < 1 or tp_size < 1:
        raise ValueError(f"vocab_size and tp_size must be >= 1, got {vocab_size}, {tp_size}")
    step = multiple * tp_size
    return -(-vocab_size // step) * step


class VocabParallelLMHead(torch.nn.Module):
    """LM head whose weight is this rank's shard ``[V_pad / TP, hidden]`` of the padded vocab.

    Rank ``r`` holds vocab rows ``[r * Sh, (r + 1) * Sh)`` with ``Sh = V_pad / TP`` and
    ``V_pad = padded_vocab_size(vocab_size, TP, pad_multiple)``; rows past ``vocab_size`` are zero padding. With
    ``vocab_parallel=False`` the head is replicated: every rank holds all ``V_pad`` rows (TP 1 layout).

    Parameters
    ----------
    vocab_size, hidden_size : int.
    group : TPGroup; its ``rank`` / ``size`` pick the shard and its ``device`` holds the weight.
    dtype : weight dtype (bf16 by default; fp32 for an fp32 head).
    vocab_parallel : bool; False for a replicated head.
    pad_multiple : int; ``V_pad`` is a multiple of ``pad_multiple * TP`` (1: no padding at TP 1).

    ``weight`` is a parameter (no gradient), so a model holding the head lists, initialises and
    loads it with its other parameters.
    """

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup, *, dtype: torch.dtype = torch.bfloat16,
                 vocab_parallel: bool = True, pad_multiple: int = VOCAB_PAD_MULTIPLE):
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.group = group
        self.vocab_parallel = vocab_parallel
        self.num_shards = group.size if vocab_parallel else 1
        self.shard_rank = group.rank if vocab_parallel else 0
        self.padded_vocab_size = padded_vocab_size(vocab_size, self.num_shards, pad_multiple)
        self.shard_size = self.padded_vocab_size // self.num_shards
        self.shard_start = self.shard_rank * self.shard_size
        self.weight = torch.nn.Parameter(torch.zeros(self.shard_size, hidden_size, dtype=dtype, device=group.device),
                                         requires_grad=False)

    @property
    def valid_columns(self) -> int:
        """Columns of this shard that are real vocab entries (the rest is padding)."""
        return max(0, min(self.vocab_size - self.shard_start, self.shard_size))

    @torch.no_grad()
    def load_weight(self, full_weight: torch.Tensor) -> None:
        """Copy this rank's shard out of the full ``[vocab_size (or more), hidden]`` weight; padding = 0.

        Parameters
        ----------
        full_weight : Tensor ``[>= vocab_size, hidden]``, any float dtype, any device; rows past
            ``vocab_size`` are ignored.
        """
        if full_weight.dim() != 2 or full_weight.shape[0] < self.vocab_size or full_weight.shape[1] != self.hidden_size:
            raise ValueError(f"full_weight must be [>= {self.vocab_size}, {self.hidden_size}], got "
                             f"{tuple(full_weight.shape)}")
        n = self.valid_columns
        self.weight.zero_()
        self.weight[:n].copy_(full_weight[self.shard_start:self.shard_start + n])

    def forward(self, hidden_states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Local logits ``hidden_states @ weight^T``.

        Parameters
        ----------
        hidden_states : Tensor ``[rows, hidden]``, dtype of the weight.
        out : optional Tensor ``[rows, Sh]``, dtype of the weight; written.

        Returns
        -------
        Tensor ``[rows, Sh]`` in the weight dtype.
        """
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.hidden_size:
            raise ValueError(f"hidden_states must be [rows, {self.hidden_size}], got {tuple(hidden_states.shape)}")
        if hidden_states.dtype != self.weight.dtype:
            raise TypeError(f"hidden_states must be {self.weight.dtype} (the head's dtype), got {hidden_states.dtype}")
        return torch.mm(hidden_states, self.weight.t(), out=out)

    def gather_logits(self, local: torch.Tensor, *, gathered: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits of the whole vocab from every rank's local logits: at TP > 1 with a
        vocab-parallel head one all-gather over ``group`` (collective), then the shards rank-major
        -> row-major and widened to fp32 in one copy, the padding columns dropped.

        Parameters
        ----------
        local : Tensor ``[rows, Sh]`` (this rank's :meth:`forward`), contiguous.
        gathered : optional Tensor ``[num_shards, rows, Sh]``, local's dtype, contiguous: the
            all-gather's output (allocated when None; unused with one shard).
        out : optional fp32 Tensor ``[rows, num_shards * Sh]``, contiguous; written (allocated when None).

        Returns
        -------
        fp32 ``[rows, vocab_size]``, a view of ``out``.
        """
        rows, shard = local.shape
        shards = self.num_shards
        if shards > 1:
            if gathered is None:
                gathered = torch.empty(shards, rows, shard, dtype=local.dtype, device=local.device)
            gathered = self.group.all_gather(local, out=gathered)
        else:
            gathered = local.unsqueeze(0)
        if out is None:
            out = torch.empty(rows, shards * shard, dtype=torch.float32, device=local.device)
        out.view(rows, shards, shard).copy_(gathered.transpose(0, 1))
        return out[:, :self.vocab_size]


def vocab_pad_multiple(group: TPGroup) -> int:
    """The vocab is padded to a multiple of ``64 * TP`` at TP > 1 and not at all at TP 1 (the
    checkpoint's shape, and TP 1 GEMMs of the vocab's own width)."""
    return VOCAB_PAD_MULTIPLE if group.size > 1 else 1


class VocabParallelEmbedding(nn.Module):
    """The token embedding (``embed_tokens.weight``), its rows split over ``group`` as the LM head
    splits the vocab: rank ``r`` holds rows ``[r * Sh, (r + 1) * Sh)`` of the padded table. Each
    rank looks up the ids it holds (zeros for the others) and one all-reduce sums the ranks: every
    output row has one non-zero contributor, so the sum is exact. At TP 1: a plain lookup."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup, device=None, dtype=None):
        super().__init__()
        self.group = group
        self.rows = padded_vocab_size(vocab_size, group.size, vocab_pad_multiple(group)) // group.size
        self.start = group.rank * self.rows
        self.shard = Shard(0, self.start, max(0, min(vocab_size - self.start, self.rows)), vocab_size)
        self.weight = nn.Parameter(torch.zeros(self.rows, hidden_size, device=device, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` int ``[R]`` -> ``[R, hidden]`` (one all-reduce at TP > 1)."""
        if self.group.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        held = (local >= 0) & (local < self.rows)
        out = F.embedding(torch.where(held, local, 0), self.weight)
        out.masked_fill_(~held[:, None], 0)
        return self.group.all_reduce(out)


class LMHead(RowInvariant, VocabParallelLMHead):
    """The LM head (``lm_head.weight``): a :class:`VocabParallelLMHead` over the model's TP group
    (the speculative runtime's LogitsProcessor runs over it), with the row-invariant GEMM when the
    model runs row-invariant. The vocab is padded only at TP > 1 (``vocab_pad_multiple``)."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup, dtype):
        super().__init__(vocab_size, hidden_size, group, dtype=dtype, pad_multiple=vocab_pad_multiple(group))
        self.shard = Shard(0, self.shard_start, self.valid_columns, vocab_size)

    def forward(self, hidden_states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Local logits ``[rows, Sh]`` (``hidden_states @ weight^T``, into ``out`` if given)."""
        if self.row_invariant:
            return row_invariant_ops().linear(hidden_states, self.weight, out=out)
        return super().forward(hidden_states, out)
