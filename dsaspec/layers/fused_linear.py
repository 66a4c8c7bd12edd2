"""One GEMM for bias-free projections of the same input: :func:`fuse_linears` builds a
:class:`FusedLinear` over its parts (:class:`~dsaspec.layers.linear.Linear` or
:class:`~dsaspec.layers.fp8_linear.Fp8Linear`), whose modules hold them as
:class:`HoldsFusedLinear`.
"""

from __future__ import annotations

import torch
from torch import nn

from dsaspec.layers.fp8_linear import Fp8Linear
from dsaspec.layers.linear import Linear
from dsaspec.ops.fp8_gemm import BLOCK


class FusedLinear(nn.Module):
    """Projections of one input as one GEMM: ``forward(x)`` returns the parts' outputs, column
    views of one ``[M, sum N_i]`` product (:func:`fuse_linears` builds it). FP8 parts also take
    ``x`` as an :class:`~dsaspec.layers.fp8_linear.Fp8Input` (its codes quantized ahead)."""

    def __init__(self, gemm: nn.Module, parts: list[nn.Module], names: tuple[str, ...]):
        super().__init__()
        self.gemm = gemm
        self.sizes = [part.out_features for part in parts]
        self._parts = tuple(parts)  # a tuple: registered where they live, under their checkpoint names
        self._names = names
        self.refuse()

    def refuse(self, into: dict[str, torch.Tensor] | None = None) -> None:
        """(Re)build the fused tensors (``names``: the weight, and the FP8 block scales) from the
        parts' current ones, on their device, and make each part's parameters row views of them.
        ``into``: the fused tensors to use, by name (of the fused shape, e.g. views of a larger
        storage: :meth:`MoE.fuse_shared_experts <dsaspec.layers.moe.MoE.fuse_shared_experts>`),
        the parts' values copied in; else new ones."""
        for name in self._names:
            parts = [getattr(p, name) for p in self._parts]
            fused = torch.cat([param.detach() for param in parts]) if into is None else into[name]
            self.gemm.register_buffer(name, fused, persistent=False)
            start = 0
            for param in parts:
                rows = fused[start:start + param.shape[0]]
                if into is not None:
                    rows.copy_(param.detach())
                param.data = rows
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
