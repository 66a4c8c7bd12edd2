"""Byte layouts of the KV caches serving engines share (docs/fp8-kv-cache.md): the page size, the
``fp8_ds_mla`` MLA entry (656 bytes a token) and the paged FP8 indexer keys (132 bytes a token), with
typed views of their bytes. Shapes only: the kernels that write and read them are in
:mod:`dsaspec.ops.fp8_kv`, the pools in :mod:`dsaspec.memory`.
"""

from __future__ import annotations

import torch

PAGE_SIZE = 64

FP8_GROUP = 128                       # values per scale
MLA_LATENT_DIM, MLA_ROPE_DIM, INDEX_HEAD_DIM = 512, 64, 128   # the only shapes the FP8 layouts have
MLA_FP8_SCALE_OFFSET = MLA_LATENT_DIM                              # 512
MLA_FP8_ROPE_OFFSET = MLA_FP8_SCALE_OFFSET + 4 * (MLA_LATENT_DIM // FP8_GROUP)   # 528
MLA_FP8_BYTES = MLA_FP8_ROPE_OFFSET + 2 * MLA_ROPE_DIM                          # 656
INDEX_FP8_BYTES = INDEX_HEAD_DIM + 4                                             # 132 a token
INDEX_FP8_PAGE_BYTES = PAGE_SIZE * INDEX_FP8_BYTES                               # 8448
INDEX_FP8_SCALE_OFFSET = PAGE_SIZE * INDEX_HEAD_DIM                              # 8192 in a page


def _byte_view(cache: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    return cache[..., start:stop].view(dtype)


def mla_fp8_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Typed views of an ``fp8_ds_mla`` cache (uint8 ``[slots, 656]``): the latent codes e4m3
    ``[slots, 512]``, the scales fp32 ``[slots, 4]`` and the rope key bf16 ``[slots, 64]``."""
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] != MLA_FP8_BYTES:
        raise ValueError(f"mla cache: expected uint8 [slots, {MLA_FP8_BYTES}], got {cache.dtype} "
                         f"{tuple(cache.shape)}")
    return (_byte_view(cache, 0, MLA_FP8_SCALE_OFFSET, torch.float8_e4m3fn),
            _byte_view(cache, MLA_FP8_SCALE_OFFSET, MLA_FP8_ROPE_OFFSET, torch.float32),
            _byte_view(cache, MLA_FP8_ROPE_OFFSET, MLA_FP8_BYTES, torch.bfloat16))


def index_k_fp8_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Typed views of an FP8 indexer key cache (uint8 ``[pages, 8448]``): the key codes e4m3
    ``[pages, 64, 128]`` and the scales fp32 ``[pages, 64]``; slot ``s`` is ``[s // 64, s % 64]``.
    (DeepGEMM's ``[pages, 64, 1, 132]`` is ``cache.view(pages, 64, 1, 132)``: the same bytes.)"""
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] != INDEX_FP8_PAGE_BYTES:
        raise ValueError(f"index_k cache: expected uint8 [pages, {INDEX_FP8_PAGE_BYTES}], got "
                         f"{cache.dtype} {tuple(cache.shape)}")
    pages = cache.shape[0]
    keys = _byte_view(cache, 0, INDEX_FP8_SCALE_OFFSET, torch.float8_e4m3fn)
    return (keys.view(pages, PAGE_SIZE, INDEX_HEAD_DIM),
            _byte_view(cache, INDEX_FP8_SCALE_OFFSET, INDEX_FP8_PAGE_BYTES, torch.float32))


def is_fp8_cache(cache: torch.Tensor) -> bool:
    """Whether a per-layer cache of a KVPool holds the FP8 byte layout (uint8)."""
    return cache.dtype == torch.uint8
