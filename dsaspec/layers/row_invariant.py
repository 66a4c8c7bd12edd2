"""The row-invariant switch of the layers whose arithmetic cuBLAS / torch would shape by the
number of rows (GEMMs, norms).
"""

from __future__ import annotations


class RowInvariant:
    """Mixin of the modules whose arithmetic cuBLAS / torch would shape by the number of rows:
    with ``row_invariant`` set (by :class:`DSAModel`) they run the kernels of
    :mod:`dsaspec.ops.row_invariant`, whose results per row do not depend on the other rows."""

    row_invariant: bool = False


def row_invariant_ops():
    from dsaspec.ops import row_invariant

    return row_invariant
