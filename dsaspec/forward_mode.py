"""The forward mode of a step: what its rows are and which live length each attends to.

Every layer of the model and every replay-metadata kernel takes one: ``DECODE`` (one row per
request at its next position), ``TARGET_VERIFY`` (N rows per request: the bonus token and the
drafts), ``DRAFT_EXTEND`` (the MTP layer over the verified rows).
"""

from __future__ import annotations

import enum

# Rows from which a forward counts as a prefill chunk: no captured step reaches it (the largest verify
# bucket is 32 requests x 6 rows). From here the default mode (not the row-invariant one) takes the
# kernels sized for many rows, whose per-row bits depend on the row count: Fp8Linear's tall e4m3-MMA
# tiles, the fused MoE's tall row blocks, the indexer's head weights as one GEMM.
PREFILL_MIN_ROWS = 512


class Mode(str, enum.Enum):
    """Forward mode of a step (and of its metadata replay)."""

    DECODE = "decode"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"
