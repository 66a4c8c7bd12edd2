"""Reference sparse MQA attention over selected slots: gather, softmax and weighted sum in fp32."""

from __future__ import annotations

import torch


def reference_sparse_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                                sm_scale: float) -> torch.Tensor:
    """fp32 ``[R, H, 512]``: per row the softmax over valid slots (``>= 0``) of
    ``sm_scale * q[r, h] . kv_cache[slot]`` applied to ``kv_cache[slot, :512]``; zeros for a row
    without a valid slot."""
    num_rows, num_heads, _ = q.shape
    out = torch.zeros(num_rows, num_heads, 512, device=q.device)
    for row in range(num_rows):
        chosen = slots[row][slots[row] >= 0].long()
        if chosen.numel() == 0:
            continue
        keys = kv_cache[chosen].float()  # [n, 576]
        probs = torch.softmax(sm_scale * (q[row].float() @ keys.T), dim=-1)  # [H, n]
        out[row] = probs @ keys[:, :512]
    return out


def _fp8_ds_mla_values(entries: torch.Tensor) -> torch.Tensor:
    """fp64 ``[n, 576]`` of ``n`` 656-byte ``fp8_ds_mla`` entries (uint8 ``[n, 656]``): bytes
    0..511 e4m3 latent codes, 512..527 four fp32 scales (scale ``g`` for latent ``128 g ..``),
    528..655 sixty-four bf16 rope values."""
    codes = entries[:, :512].contiguous().view(torch.float8_e4m3fn).double()
    scales = entries[:, 512:528].contiguous().view(torch.float32).double()
    rope = entries[:, 528:656].contiguous().view(torch.bfloat16).double()
    latent = (codes.view(-1, 4, 128) * scales[:, :, None]).view(-1, 512)
    return torch.cat((latent, rope), dim=1)


def reference_sparse_mla_decode_fp8(q: torch.Tensor, kv_bytes: torch.Tensor, slots: torch.Tensor,
                                    sm_scale: float, absolute_values: bool = False) -> torch.Tensor:
    """fp32 ``[R, H, 512]`` (computed in fp64): :func:`reference_sparse_mla_decode` over an
    ``fp8_ds_mla`` cache (uint8 ``[num_slots, 656]``), each selected entry dequantized from its
    bytes (latent code * its group's scale | rope); only the selected entries are read. With
    ``absolute_values``: ``sum_j p_j |v_j|`` instead (same probabilities), the magnitude that
    bounds a rounding of the probabilities in the value product."""
    num_rows, num_heads, _ = q.shape
    out = torch.zeros(num_rows, num_heads, 512, dtype=torch.float64, device=q.device)
    for row in range(num_rows):
        chosen = slots[row][slots[row] >= 0].long()
        if chosen.numel() == 0:
            continue
        keys = _fp8_ds_mla_values(kv_bytes[chosen])  # [n, 576]
        probs = torch.softmax(sm_scale * (q[row].double() @ keys.T), dim=-1)  # [H, n]
        values = keys[:, :512]
        out[row] = probs @ (values.abs() if absolute_values else values)
    return out.float()
