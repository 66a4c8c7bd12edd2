"""Metadata of the MTP draft decode: every draft step backend gets identical DECODE metadata.

:func:`draft_decode_metadata` writes every step backend's buffers straight from ``req_to_token``
with the live-bounded kernel, one launch per four backends, no scratch. What engines do today
(precompute into a scratch set, then copies) is the baseline in
:mod:`dsaspec.ops.baseline.draft_decode_metadata` (docs/metadata-kernels.md).
"""

from __future__ import annotations

from typing import Sequence

import torch

from dsaspec.ops.dsa_metadata import bounded_metadata
from dsaspec.ops.dsa_metadata_common import MetadataBuffers
from dsaspec.forward_mode import Mode


def draft_decode_metadata(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                          seq_lens: torch.Tensor, outs: Sequence[MetadataBuffers], *,
                          index_topk: int, page_size: int, budget: int | None = None,
                          check_values: bool = True) -> None:
    """New path: live-bounded DECODE metadata written straight into every step backend's buffers,
    one launch per four buffer sets. Arguments, ``check_values`` and what happens without it: see
    :func:`dsaspec.ops.dsa_metadata.bounded_metadata`."""
    if not outs:
        raise ValueError("outs: at least one step backend buffer set is required")
    bounded_metadata(Mode.DECODE, req_to_token, req_pool_indices, seq_lens, outs,
                     index_topk=index_topk, page_size=page_size, budget=budget,
                     check_values=check_values)
