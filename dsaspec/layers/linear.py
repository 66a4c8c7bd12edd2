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


class FusedLinear(nn.Module):
    """Projections of one input as one GEMM: ``forward(x)`` returns the parts' outputs, column
    views of one ``[M, sum N_i]`` product (:func:`fuse_linears` builds it)."""

    def __init__(self, gemm: nn.Module, parts: list[nn.Module], names: tuple[str, ...]):
        super().__init__()
        self.gemm = gemm
        self.sizes = [part.out_features for part in parts]
        self._parts = tuple(parts)  # a tuple: registered where they live, under their checkpoint names
        self._names = names
        self.refuse()

    def refuse(self) -> None:
        """(Re)build the fused tensors (``names``: the weight, and the FP8 block scales) from the
        parts' current ones, on their device, and make each part's parameters row views of them."""
        for name in self._names:
            fused = torch.cat([getattr(p, name).detach() for p in self._parts])
            self.gemm.register_buffer(name, fused, persistent=False)
            start = 0
            for p in self._parts:
                param = getattr(p, name)
                param.data = fused[start:start + param.shape[0]]
                start += param.shape[0]
        self._views = [(part.weight.data_ptr(), self.gemm.weight.data_ptr()) for part in self._parts]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if [(p.weight.data_ptr(), self.gemm.weight.data_ptr()) for p in self._parts] != self._views:
            raise RuntimeError("FusedLinear: the parts' weights no longer view the fused weight (a part's "
                               "tensor was replaced, or a part moved on its own); move the module holding "
                               "the parts and the fused layer, which fuses them again")
        return self.gemm(x).split(self.sizes, dim=-1)


class HoldsFusedLinear:
    """For a module holding :class:`FusedLinear` children next to their parts: a move or
    conversion of it (``.to``, ``.cuda``, ``.float`` ..., directly or through a parent) moves the
    parts and the fused tensors separately, so afterwards each fused child is rebuilt from its
    parts (:meth:`FusedLinear.refuse`)."""

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        for child in self.children():
            if isinstance(child, FusedLinear):
                child.refuse()
        return module


def fuse_linears(parts: list[nn.Module]) -> FusedLinear | None:
    """One GEMM for bias-free projections of the same input (:class:`Linear` or, all of them,
    :class:`~dsaspec.layers.fp8_linear.Fp8Linear`), or None where they cannot share one: other
    types, input features, dtypes or FP8 activation scale formats, or an FP8 part other than the
    last whose output features are not a multiple of 128 (its last scale block would hold rows of
    the next part).

    The fused layer holds the parts' weights (and block scales) one after the other along the
    output features, as non-persistent buffers; each part's parameters become row views of them,
    so whatever writes the parts (``init_weights``, a checkpoint load) writes the fused layer, and
    the state dict keeps the parts' names and shapes. A TP rank fuses its own shards. The module
    holding the parts and the fused layer must be a :class:`HoldsFusedLinear`."""
    from dsaspec.layers.fp8_linear import Fp8Linear
    from dsaspec.ops.fp8_gemm import BLOCK

    first = parts[0]
    kind = type(first)
    if kind not in (Linear, Fp8Linear) or any(type(p) is not kind or p.in_features != first.in_features
                                              or p.weight.dtype != first.weight.dtype for p in parts):
        return None
    names = ("weight",)
    if kind is Fp8Linear:
        if any(p.scale_fmt != first.scale_fmt or p.dtype != first.dtype for p in parts) or \
                any(p.out_features % BLOCK for p in parts[:-1]):
            return None
        names = ("weight", "weight_scale_inv")
    out_features = sum(p.out_features for p in parts)
    if kind is Linear:
        gemm = Linear(first.in_features, out_features, bias=False, device="meta", dtype=first.weight.dtype)
    else:
        gemm = Fp8Linear(first.in_features, out_features, "meta", dtype=first.dtype, scale_fmt=first.scale_fmt)
    for name in names:
        delattr(gemm, name)
    return FusedLinear(gemm, parts, names)


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


def bmm(a: torch.Tensor, b: torch.Tensor, row_invariant: bool) -> torch.Tensor:
    """``a[i] @ b[i]`` (cuBLAS, or the row-invariant GEMM)."""
    return row_invariant_ops().bmm(a, b) if row_invariant else torch.bmm(a, b)
