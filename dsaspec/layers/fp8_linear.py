"""The FP8 block-scaled linear layer: e4m3 ``weight`` and fp32 ``weight_scale_inv`` held as the
checkpoint stores them (no dequantize at load), and the activations it can take quantized ahead
(:class:`ActQuant`, :class:`Fp8Input`: the RMSNorm before it writes them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsaspec.layers.linear import Linear, Shard
from dsaspec.layers.row_invariant import RowInvariant, row_invariant_ops
from dsaspec.forward_mode import PREFILL_MIN_ROWS
from dsaspec.ops.fp8_gemm import BLOCK, dequantize_weight, fp8_gemm, fp8_linear, quantize_blocks, quantize_weight


def _blocks(size: int) -> int:
    return -(-size // BLOCK)


@dataclass(frozen=True)
class ActQuant:
    """How the FP8 GEMMs reading an activation quantize it: per token per 128 columns with
    ``scale_fmt`` (None or ``"ue8m0"``; :func:`~dsaspec.ops.fp8_gemm.act_quant`). Handed to the
    kernel that writes the activation (:class:`~dsaspec.layers.norm.RMSNorm`) so that it writes
    the codes too (:class:`Fp8Input`)."""

    scale_fmt: str | None


@dataclass(frozen=True)
class Fp8Input:
    """Rows ``x`` (bf16 / fp32 ``[M, K]``) with their ``act_quant(x, scale_fmt)``, written by the
    launch that wrote ``x``: ``codes`` e4m3 ``[M, K]``, ``scales`` fp32 ``[M, K / 128]``. An
    :class:`Fp8Linear` of that ``scale_fmt`` takes it for ``x`` and multiplies the codes (no
    quantization of its own); whatever reads the activation in its dtype reads ``x``."""

    x: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    scale_fmt: str | None


def act_quant_of(layers: list[nn.Module]) -> ActQuant | None:
    """The quantization that every one of ``layers`` (the GEMMs reading one activation) applies to
    its input: ``ActQuant(scale_fmt)`` when all are :class:`Fp8Linear` of one ``scale_fmt``, else
    None (some read the activation as it is)."""
    if not layers or not all(isinstance(layer, Fp8Linear) for layer in layers):
        return None
    formats = {layer.scale_fmt for layer in layers}
    return ActQuant(formats.pop()) if len(formats) == 1 else None


class Fp8Linear(RowInvariant, nn.Module):
    """Bias-free ``y = x @ W^T`` with ``W [N, K] = weight * weight_scale_inv`` per 128 x 128 block
    (``weight`` e4m3 ``[N, K]``, ``weight_scale_inv`` fp32 ``[ceil(N / 128), K / 128]``; ``K`` a
    multiple of 128). The activations are quantized per token per 128 columns (``scale_fmt``), then
    ``use_triton``: the Triton FP8 GEMM (:func:`~dsaspec.ops.fp8_gemm.fp8_linear`, row-invariant by
    construction; ``fast_accum``, set by the model from ``RuntimeOptions.fp8_fast_accum``: its
    64-row tiles from 32 rows; without it from ``PREFILL_MIN_ROWS`` rows, the prefill chunks,
    unless ``row_invariant``: :meth:`tall_tiles`); else plain torch, the same quantization and an fp32 dequantize-then-matmul
    (the row-invariant GEMM when ``row_invariant``). Output in ``x``'s dtype. ``forward`` also
    takes an :class:`Fp8Input` of its ``scale_fmt`` for ``x``: its codes and scales replace the
    quantization (the same bits), and with ``use_triton`` the GEMM is
    :func:`~dsaspec.ops.fp8_gemm.fp8_gemm` of them: one launch where ``x`` takes two.

    ``shard`` / ``scale_shard``: this rank's part of the checkpoint weight and of its scales (None:
    replicated); a split lies on 128-row / column block boundaries."""

    use_triton: bool = False
    fast_accum: bool = False

    def __init__(self, in_features: int, out_features: int, device=None, *, dtype=torch.bfloat16,
                 scale_fmt: str | None = None, shard: Shard | None = None):
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(f"Fp8Linear: in_features = {in_features} must be a multiple of {BLOCK} "
                             "(the FP8 weight_block_size)")
        self.in_features, self.out_features = in_features, out_features
        self.dtype = dtype
        self.scale_fmt = scale_fmt
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn,
                                               device=device), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(_blocks(out_features), in_features // BLOCK,
                                                         dtype=torch.float32, device=device), requires_grad=False)
        self.shard = shard
        self._dense = None                 # (the weights' versions, dense_weight()) once asked for
        self.scale_shard = None if shard is None else Shard(shard.dim, shard.start // BLOCK, _blocks(shard.valid),
                                                            _blocks(shard.full))

    @classmethod
    def like(cls, linear: Linear, name: str, scale_fmt: str | None, device=None) -> "Fp8Linear":
        """An FP8 layer of ``linear``'s shape and tensor-parallel split (module ``name`` in errors);
        raises ``ValueError`` when the split does not lie on 128-feature block boundaries."""
        shard = linear.shard
        if shard is not None and (shard.start % BLOCK or shard.valid % BLOCK):
            side = "output" if shard.dim == 0 else "input"
            raise ValueError(f"{name}: the tensor-parallel shard of its {shard.full} {side} features is "
                             f"[{shard.start}, {shard.start + shard.valid}), not on {BLOCK}-feature boundaries: "
                             "the FP8 block scales cannot be split there")
        if linear.in_features % BLOCK:
            raise ValueError(f"{name}: in_features = {linear.in_features} must be a multiple of {BLOCK} "
                             "for FP8 weights (weight_block_size [128, 128])")
        return cls(linear.in_features, linear.out_features, device, dtype=linear.weight.dtype,
                   scale_fmt=scale_fmt, shard=shard)

    @torch.no_grad()
    def set_dense(self, weight: torch.Tensor) -> None:
        """Quantize ``weight`` (float ``[N, K]``, this rank's part) into ``weight`` / ``weight_scale_inv``."""
        q, s = quantize_weight(weight.to(self.weight.device))
        self.weight.copy_(q)
        self.weight_scale_inv.copy_(s)

    def dense_weight(self) -> torch.Tensor:
        """The dequantized weight ``[N, K]`` in the layer's dtype. Computed once and kept until
        ``weight`` or ``weight_scale_inv`` is written or replaced (their version counters and
        storage), so a forward that multiplies by it (MLA's absorbed ``kv_b_proj``) does not
        dequantize again each call; a CUDA graph captured after the first call reads the kept
        tensor, so weights written after that capture need a new capture."""
        key = tuple((t._version, t.data_ptr(), t.device) for t in (self.weight, self.weight_scale_inv))
        if self._dense is None or self._dense[0] != key:
            self._dense = (key, dequantize_weight(self.weight, self.weight_scale_inv, self.dtype))
        return self._dense[1]

    def tall_tiles(self, rows: int) -> bool:
        """Whether the Triton GEMM of ``rows`` rows takes the tall e4m3-MMA tiles (its
        ``fast_accum``): with ``fast_accum`` set, else from ``PREFILL_MIN_ROWS`` rows unless
        ``row_invariant`` (every row's bits then depend on whether its call reached that many). In
        a 4,096-row prefill chunk of the GLM-5 rank the 16-row tiles ran 7x their FLOP floor
        (benchmarks/results/h200/logs/prefill_glm5_rank_session22.md)."""
        return self.fast_accum or (not self.row_invariant and rows >= PREFILL_MIN_ROWS)

    def forward(self, x: torch.Tensor | Fp8Input) -> torch.Tensor:
        if isinstance(x, Fp8Input):
            if x.scale_fmt != self.scale_fmt:
                raise ValueError(f"Fp8Linear: the input was quantized with scale_fmt {x.scale_fmt!r}, "
                                 f"this layer's is {self.scale_fmt!r}")
            if self.use_triton:
                return fp8_gemm(x.codes, x.scales, self.weight, self.weight_scale_inv, out_dtype=x.x.dtype,
                                fast_accum=self.tall_tiles(x.codes.shape[0]))
            q, s, x = x.codes, x.scales, x.x
        elif self.use_triton:
            return fp8_linear(x, self.weight, self.weight_scale_inv, self.scale_fmt,
                              fast_accum=self.tall_tiles(x.shape[0]))
        else:
            q, s = quantize_blocks(x, 1, self.scale_fmt)
        a = q.float() * s.repeat_interleave(BLOCK, dim=1)
        w = dequantize_weight(self.weight, self.weight_scale_inv, torch.float32)
        y = row_invariant_ops().linear(a, w) if self.row_invariant else F.linear(a, w)
        return y.to(x.dtype)
