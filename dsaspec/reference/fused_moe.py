"""Pure PyTorch definition of the fused MoE (``dsaspec.ops.fused_moe``): a loop over tokens and
their experts in fp64, with the op's one intermediate rounding (the activation, to the hidden
dtype) and the output rounded once. The op accumulates in fp32, so the two agree within a
tolerance. :func:`fused_moe_fp8` is the same loop over FP8 block-scaled experts: dequantize the
weights, quantize the hidden row and the activation per 128 columns (``reference.fp8_gemm``), then
the same fp64 matmuls. ``shared``: the MoE layer's shared experts as the one SwiGLU of the model's
definition (``n_shared * I`` features, weight 1 for every token), however the op splits them."""

from __future__ import annotations

import torch

from dsaspec.reference import fp8_gemm


def _swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
    """``down @ (silu(gate @ x) * (up @ x))`` in fp64, the activation rounded to ``dtype``."""
    g, u = gate.double() @ x, up.double() @ x
    return down.double() @ (g * torch.sigmoid(g) * u).to(dtype).double()


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, shared: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(gate) * up)`` with ``gate, up =
    w13[e, :I] @ x, w13[e, I:] @ x``, ``x = hidden[t]``, ``e = topk_ids[t, j]``; ``hidden [T, H]``,
    ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, ``topk_ids``/``topk_weights [T, k]`` -> ``[T, H]`` in
    hidden's dtype. ``silu(gate) * up`` is rounded to hidden's dtype before the down projection.
    ``shared``: None or ``(gate [W, H], up [W, H], down [H, W])``, whose SwiGLU is added to every
    token's output (its activation rounded likewise)."""
    inter = w13.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float64, device=hidden.device)
    for t, row in enumerate(topk_ids.tolist()):
        x = hidden[t].double()
        for j, e in enumerate(row):
            out[t] += topk_weights[t, j].double() * _swiglu(x, w13[e, :inter], w13[e, inter:], w2[e], hidden.dtype)
        if shared is not None:
            out[t] += _swiglu(x, *shared, hidden.dtype)
    return out.to(hidden.dtype)


def _swiglu_fp8(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, dtype: torch.dtype,
                scale_fmt: str | None) -> torch.Tensor:
    """:func:`_swiglu` from the dequantized ``gate_up = [gate; up]`` and ``down`` (fp64), the
    activation rounded to ``dtype``, then replaced by its ``act_quant`` dequantized."""
    gate, up = (gate_up @ x).chunk(2)
    act = (gate * torch.sigmoid(gate) * up).to(dtype)
    return down @ fp8_gemm.dequantize(*fp8_gemm.act_quant(act[None], scale_fmt), 1)[0]


def fused_moe_fp8(hidden: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                  w2_scale: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  scale_fmt: str | None = None,
                  shared: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None) -> torch.Tensor:
    """:func:`fused_moe` with e4m3 ``w13 [E, 2I, H]`` / ``w2 [E, H, I]`` and their fp32 scales per
    128 x 128 block (``[E, 2I / 128, H / 128]``, ``[E, H / 128, I / 128]``): ``W = w * scale``;
    ``x`` is replaced by its :func:`~dsaspec.reference.fp8_gemm.act_quant` dequantized (per 128
    columns, ``scale_fmt``), and so is the activation after its rounding to hidden's dtype.
    ``shared``: None or ``((gate, scale), (up, scale), (down, scale))``, e4m3 ``[W, H]``, ``[W, H]``,
    ``[H, W]`` with their block scales (W a multiple of 128), added to every token's output."""

    def dense(codes_and_scale):
        return fp8_gemm.dequantize(*codes_and_scale, fp8_gemm.GROUP)

    out = torch.zeros(hidden.shape, dtype=torch.float64, device=hidden.device)
    if shared is not None:
        shared_gate_up, shared_down = torch.cat([dense(shared[0]), dense(shared[1])]), dense(shared[2])
    for t, row in enumerate(topk_ids.tolist()):
        x = fp8_gemm.dequantize(*fp8_gemm.act_quant(hidden[t:t + 1], scale_fmt), 1)[0]
        for j, e in enumerate(row):
            down = _swiglu_fp8(x, dense((w13[e], w13_scale[e])), dense((w2[e], w2_scale[e])), hidden.dtype, scale_fmt)
            out[t] += topk_weights[t, j].double() * down
        if shared is not None:
            out[t] += _swiglu_fp8(x, shared_gate_up, shared_down, hidden.dtype, scale_fmt)
    return out.to(hidden.dtype)
