"""Pure PyTorch definition of :func:`dsaspec.ops.absorb_v.absorb_v_quant`: the value absorption of
the MLA output in fp64, rounded once to bf16, and the reference ``act_quant`` of that."""

from __future__ import annotations

import torch

from dsaspec.reference.fp8_gemm import act_quant


def absorb_v_quant(o_latent: torch.Tensor, w_uv: torch.Tensor, scale_fmt: str | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``o [R, H * V] = bf16(einsum('rhl,hvl->rhv'))`` of ``o_latent [R, H, L]`` and ``w_uv
    [H, V, L]`` summed in fp64, with its per-token per-128-column codes and scales
    (:func:`dsaspec.reference.fp8_gemm.act_quant`). Equal to the op's bits where the fp32 sums
    are exact; within the fp32 summation error otherwise."""
    rows, heads, _ = o_latent.shape
    o = torch.einsum("rhl,hvl->rhv", o_latent.double(), w_uv.double()).reshape(rows, -1).to(torch.bfloat16)
    codes, scales = act_quant(o, scale_fmt)
    return o, codes, scales
