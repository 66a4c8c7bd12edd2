"""Pure PyTorch definitions of the FP8 KV cache writes and reads (``dsaspec.ops.fp8_kv``), built
from the byte layouts as written down (FlashMLA's ``fp8_ds_mla``; DeepGEMM's paged indexer
cache), one slot at a time. Codes and scales are bit-exact contracts."""

from __future__ import annotations

import torch

from dsaspec.reference.fp8_gemm import act_quant

MLA_ENTRY = 656          # 512 e4m3 | 4 fp32 | 64 bf16
INDEX_PAGE = 64 * 132    # 64 x 128 e4m3 | 64 fp32
PAGE = 64


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def mla_entry(row: torch.Tensor) -> torch.Tensor:
    """The 656 bytes of one MLA row ``[576]``: ue8m0 act_quant of the latent per 128, its 4 scales
    as fp32, the rope key as bf16."""
    codes, scales = act_quant(row[None, :512].float(), "ue8m0")
    return torch.cat((_bytes(codes), _bytes(scales), _bytes(row[512:].to(torch.bfloat16))))


def mla_value(entry: torch.Tensor) -> torch.Tensor:
    """fp32 ``[576]`` of a 656-byte entry: code * scale of its group | rope key."""
    codes = entry[:512].clone().view(torch.float8_e4m3fn).float()
    scales = entry[512:528].clone().view(torch.float32)
    rope = entry[528:656].clone().view(torch.bfloat16).float()
    return torch.cat((codes * scales.repeat_interleave(128), rope))


def write_mla(pool: torch.Tensor, slots, rows: torch.Tensor) -> torch.Tensor:
    """A copy of ``pool`` (uint8 ``[S, 656]``) with ``rows[i]`` written at ``slots[i]`` in order."""
    pool = pool.clone()
    for slot, row in zip(torch.as_tensor(slots).tolist(), rows):
        pool[slot] = mla_entry(row)
    return pool


def read_mla(pool: torch.Tensor, slots) -> torch.Tensor:
    """fp32 ``[*slots.shape, 576]``: the entries of ``slots``, zeros for a negative slot."""
    slots = torch.as_tensor(slots)
    values = [mla_value(pool[s]) if s >= 0 else torch.zeros(576) for s in slots.reshape(-1).tolist()]
    return torch.stack(values).reshape(*slots.shape, 576) if values else torch.zeros(*slots.shape, 576)


def write_index_k(pool: torch.Tensor, slots, keys: torch.Tensor) -> torch.Tensor:
    """A copy of ``pool`` (uint8 ``[pages, 8448]``) with ``keys[i]`` (``[128]``) quantized at
    ``slots[i]``: codes at page bytes ``128 * o``, the fp32 scale at ``8192 + 4 * o``, ``o = slot % 64``."""
    pool = pool.clone()
    for slot, key in zip(torch.as_tensor(slots).tolist(), keys):
        codes, scale = act_quant(key[None].float(), "ue8m0")
        page, o = divmod(slot, PAGE)
        pool[page, 128 * o:128 * o + 128] = _bytes(codes)
        pool[page, 8192 + 4 * o:8192 + 4 * o + 4] = _bytes(scale)
    return pool


def read_index_k(pool: torch.Tensor, slots) -> torch.Tensor:
    """fp32 ``[*slots.shape, 128]``: code * scale of each slot's key, zeros for a negative slot."""
    slots = torch.as_tensor(slots)
    out = torch.zeros(slots.numel(), 128)
    for i, slot in enumerate(slots.reshape(-1).tolist()):
        if slot >= 0:
            page, o = divmod(slot, PAGE)
            codes = pool[page, 128 * o:128 * o + 128].clone().view(torch.float8_e4m3fn).float()
            out[i] = codes * pool[page, 8192 + 4 * o:8192 + 4 * o + 4].clone().view(torch.float32)
    return out.reshape(*slots.shape, 128)
