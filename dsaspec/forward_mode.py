"""The forward mode of a step: what its rows are and which live length each attends to.

Every layer of the model and every replay-metadata kernel takes one: ``DECODE`` (one row per
request at its next position), ``TARGET_VERIFY`` (N rows per request: the bonus token and the
drafts), ``DRAFT_EXTEND`` (the MTP layer over the verified rows).
"""

from __future__ import annotations

import enum


class Mode(str, enum.Enum):
    """Forward mode of a step (and of its metadata replay)."""

    DECODE = "decode"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"
