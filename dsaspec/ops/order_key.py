"""The fp32 order key of the torch-side code: integers that sort like fp32 values.

The Triton kernels compute the same key in-kernel (``_order_key`` in :mod:`dsaspec.ops.topk`, as
uint32); the argmax exchange uses its own variant (-0 == +0, every NaN on top) in
:mod:`dsaspec.ops.argmax_exchange`.
"""

from __future__ import annotations

import torch


def fp32_order_key(values: torch.Tensor) -> torch.Tensor:
    """int64 keys in ``[0, 2**32)``, same shape as ``values`` (any float dtype, widened to fp32),
    ordered like the fp32 bit patterns: for finite values the float order, with -0.0 below +0.0;
    NaNs by sign beyond the infinities. Of the int32 bits ``b``: ``b | 2**31`` where ``b >= 0``,
    ``~b`` (``-b - 1``, below ``2**31``) where ``b < 0``."""
    bits = values.float().contiguous().view(torch.int32).long()
    return torch.where(bits < 0, bits.bitwise_not(), bits | 0x80000000)
