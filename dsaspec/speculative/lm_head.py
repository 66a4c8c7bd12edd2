"""The LM head: vocab-parallel (each rank holds a contiguous slice of the padded vocab) or replicated."""

from __future__ import annotations

import torch

from dsaspec.distributed.tp_group import TPGroup

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
