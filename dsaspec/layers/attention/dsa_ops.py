"""Which implementation of the four DSA ops a model runs: the Triton kernels or plain torch.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace


@functools.lru_cache(maxsize=5)
def dsa_ops(use_triton: bool, sparse_mla_gluon: bool, sparse_mla_slot_major: bool) -> SimpleNamespace:
    """The four DSA ops (``indexer_schedule``, ``indexer_logits``, ``topk_slots``,
    ``sparse_mla_decode``) with the signatures of ``dsaspec.ops`` (``out=`` and ``check_values``)
    and the two cache writes (``store_mla``, ``store_index_k``: a copy, or quantize-on-write into
    an FP8 cache), and the fused epilogues: the indexer's query, key and head weights in one
    launch (``indexer_epilogues`` of :mod:`dsaspec.ops.index_rope`), the MLA latent's norm + RoPE + store
    (``store_mla_normed``, :mod:`dsaspec.ops.mla_latent`) and the absorbed query's assembly with
    its RoPE (``mla_query``, the same module); ``None`` on the torch path, where the
    layers run their torch ops:
    the Triton kernels when ``use_triton`` (sparse MLA's Gluon kernel where its default
    configuration takes it, unless ``sparse_mla_gluon`` is off, on an ``fp8_ds_mla`` layer cache
    with its FP8 tiles, chosen from the cache's dtype on the host; at 8 and 16 heads in its slot-major
    form unless ``sparse_mla_slot_major`` is off), else the runtime's plain-torch
    versions (:mod:`dsaspec.layers.attention.torch_ops`; eager only: they read lengths on the host)."""
    if use_triton:
        from dsaspec.ops.indexer import indexer_logits
        from dsaspec.ops.indexer_schedule import indexer_schedule
        from dsaspec.ops.sparse_mla import sparse_mla_decode
        from dsaspec.ops.fp8_kv import store_index_k, store_mla
        from dsaspec.ops.index_rope import indexer_epilogues
        from dsaspec.ops.mla_latent import mla_query, store_mla_normed
        from dsaspec.ops.topk import topk_slots
        if not sparse_mla_gluon or not sparse_mla_slot_major:
            sparse_mla_decode = functools.partial(_sparse_mla_decode_configured, gluon=sparse_mla_gluon,
                                                  slot_major=sparse_mla_slot_major)
    else:
        from dsaspec.layers.attention.torch_ops import (indexer_logits, indexer_schedule, sparse_mla_decode,
                                                        store_index_k, store_mla, topk_slots)
        indexer_epilogues = store_mla_normed = mla_query = None
    return SimpleNamespace(indexer_schedule=indexer_schedule, indexer_logits=indexer_logits,
                           topk_slots=topk_slots, sparse_mla_decode=sparse_mla_decode,
                           store_mla=store_mla, store_index_k=store_index_k,
                           indexer_epilogues=indexer_epilogues,
                           store_mla_normed=store_mla_normed, mla_query=mla_query)


def _sparse_mla_decode_configured(q, kv_cache, slots, sm_scale, out, *, gluon: bool, slot_major: bool,
                                  workspace=None, **kwargs):
    """``sparse_mla_decode`` with the configuration ``sparse_mla_config`` gives these rows: the
    Gluon kernel's only with ``gluon``, its slot-major form only with ``slot_major``."""
    from dsaspec.ops.kv_cache_layout import is_fp8_cache
    from dsaspec.ops.sparse_mla import sparse_mla_config, sparse_mla_decode

    config = sparse_mla_config(q.shape[0], q.shape[1], split=workspace is not None,
                               device=q.device if gluon else None, fp8_cache=is_fp8_cache(kv_cache),
                               slot_major=slot_major)
    return sparse_mla_decode(q, kv_cache, slots, sm_scale, out, workspace=workspace, config=config,
                             **kwargs)
