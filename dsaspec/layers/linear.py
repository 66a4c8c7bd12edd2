"""Bias-free linear layers, replicated or split over a tensor-parallel group (column or row
parallel), and where each rank's part comes from in its checkpoint tensor (:class:`Shard`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsaspec.distributed.tp_group import TPGroup
from dsaspec.layers.row_invariant import RowInvariant, row_invariant_ops


@dataclass(frozen=True)
class Shard:
    """Where a tensor-parallel parameter comes from in its checkpoint tensor: along dim ``dim``
    (checkpoint size ``full``), checkpoint indices ``[start, start + valid)`` are the local indices
    ``[0, valid)``; local indices past ``valid`` (vocab padding) hold zeros."""

    dim: int
    start: int
    valid: int
    full: int

    def full_shape(self, local_shape) -> tuple[int, ...]:
        """The checkpoint shape of a parameter of ``local_shape``."""
        shape = list(local_shape)
        shape[self.dim] = self.full
        return tuple(shape)

    def index(self, ndim: int) -> tuple[slice, ...]:
        """The slices of the checkpoint tensor (``ndim`` dims) this rank holds."""
        index = [slice(None)] * ndim
        index[self.dim] = slice(self.start, self.start + self.valid)
        return tuple(index)

    def fill(self, param: torch.Tensor, part: torch.Tensor) -> None:
        """Write ``part`` (the checkpoint tensor at :meth:`index`, any dtype) into ``param``; zero
        the padding."""
        local = param.shape[self.dim]
        if self.valid < local:
            param.narrow(self.dim, self.valid, local - self.valid).zero_()
        param.narrow(self.dim, 0, self.valid).copy_(part)


class Linear(RowInvariant, nn.Linear):
    """Bias-free ``y = x @ weight.T`` (cuBLAS, or the row-invariant GEMM). ``shard``: this rank's
    part of the checkpoint weight (None: replicated)."""

    shard: Shard | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_invariant:
            return row_invariant_ops().linear(x, self.weight)
        return F.linear(x, self.weight)

    def dense_weight(self) -> torch.Tensor:
        """The weight ``[N, K]`` (as :meth:`Fp8Linear.dense_weight <dsaspec.layers.fp8_linear.Fp8Linear.dense_weight>`)."""
        return self.weight


COLUMN, ROW = "column", "row"


def make_linear(in_features: int, out_features: int, device, dtype, *, group: TPGroup | None = None,
            split: str | None = None) -> Linear:
    """A bias-free :class:`Linear`, replicated, or split over ``group``: ``COLUMN`` parallel (this
    rank's contiguous block of the output features) or ``ROW`` parallel (its block of the input
    features; the partial outputs need a sum over the group)."""
    if split is None or group.size == 1:
        return Linear(in_features, out_features, bias=False, device=device, dtype=dtype)
    dim, full = (0, out_features) if split == COLUMN else (1, in_features)
    local = full // group.size
    shape = (out_features, local) if split == ROW else (local, in_features)
    module = Linear(shape[1], shape[0], bias=False, device=device, dtype=dtype)
    module.shard = Shard(dim, group.rank * local, local, full)
    return module


def bmm(a: torch.Tensor, b: torch.Tensor, row_invariant: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a[i] @ b[i]`` (cuBLAS, or the row-invariant GEMM), into ``out`` (``[B, M, N]``, unit last
    stride, any other strides) when given; returns the result."""
    if row_invariant:
        return row_invariant_ops().bmm(a, b, out)
    return torch.bmm(a, b) if out is None else torch.bmm(a, b, out=out)
