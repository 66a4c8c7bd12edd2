"""Pure PyTorch definition of the fused MoE (``dsaspec.ops.fused_moe``): a loop over tokens and
their experts in fp64, with the op's one intermediate rounding (the activation, to the hidden
dtype) and the output rounded once. The op accumulates in fp32, so the two agree within a
tolerance. :func:`fused_moe_fp8` is the same loop over FP8 block-scaled experts: dequantize the
weights, quantize the hidden row and the activation per 128 columns (``reference.fp8_gemm``), then
the same fp64 matmuls."""

from __future__ import annotations

import torch

from dsaspec.reference import fp8_gemm


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(gate) * up)`` with ``gate, up =
    w13[e, :I] @ x, w13[e, I:] @ x``, ``x = hidden[t]``, ``e = topk_ids[t, j]``; ``hidden [T, H]``,
    ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, ``topk_ids``/``topk_weights [T, k]`` -> ``[T, H]`` in
    hidden's dtype. ``silu(gate) * up`` is rounded to hidden's dtype before the down projection."""
    inter = w13.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float64, device=hidden.device)
    for t, row in enumerate(topk_ids.tolist()):
        x = hidden[t].double()
        for j, e in enumerate(row):
            gate = w13[e, :inter].double() @ x
            up = w13[e, inter:].double() @ x
            act = (gate * torch.sigmoid(gate) * up).to(hidden.dtype).double()
            out[t] += topk_weights[t, j].double() * (w2[e].double() @ act)
    return out.to(hidden.dtype)


def fused_moe_fp8(hidden: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                  w2_scale: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  scale_fmt: str | None = None) -> torch.Tensor:
    """:func:`fused_moe` with e4m3 ``w13 [E, 2I, H]`` / ``w2 [E, H, I]`` and their fp32 scales per
    128 x 128 block (``[E, 2I / 128, H / 128]``, ``[E, H / 128, I / 128]``): ``W = w * scale``;
    ``x`` is replaced by its :func:`~dsaspec.reference.fp8_gemm.act_quant` dequantized (per 128
    columns, ``scale_fmt``), and so is the activation after its rounding to hidden's dtype."""
    inter = w13.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float64, device=hidden.device)
    for t, row in enumerate(topk_ids.tolist()):
        x = fp8_gemm.dequantize(*fp8_gemm.act_quant(hidden[t:t + 1], scale_fmt), 1)[0]
        for j, e in enumerate(row):
            gate_up = fp8_gemm.dequantize(w13[e], w13_scale[e], fp8_gemm.GROUP) @ x
            gate, up = gate_up[:inter], gate_up[inter:]
            act = (gate * torch.sigmoid(gate) * up).to(hidden.dtype)
            act = fp8_gemm.dequantize(*fp8_gemm.act_quant(act[None], scale_fmt), 1)[0]
            down = fp8_gemm.dequantize(w2[e], w2_scale[e], fp8_gemm.GROUP) @ act
            out[t] += topk_weights[t, j].double() * down
    return out.to(hidden.dtype)
