"""The torch-side fp32 order key (``dsaspec.ops.order_key``): equal to the reference's key, and
ordered like the floats (-0.0 below +0.0, NaNs by sign beyond the infinities)."""

import torch

from dsaspec.ops.order_key import fp32_order_key
from dsaspec.reference.topk import float_order_key

SPECIAL_BITS = [0x7FC00000, 0xFFC00000, 0x7F800000, 0xFF800000, 0x80000000, 0x00000000, 0x00000001,
                0x80000001, 0x7F7FFFFF, 0xFF7FFFFF, 0x3FC00000, 0xBFC00000]


def _floats(bits) -> torch.Tensor:
    return torch.as_tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def test_order_key_is_the_reference_key_and_orders_like_the_floats():
    gen = torch.Generator().manual_seed(0)
    values = torch.cat([_floats(SPECIAL_BITS), _floats(torch.randint(0, 1 << 32, (4096,), generator=gen)),
                        torch.randn(4096, generator=gen)])
    keys = fp32_order_key(values)
    assert keys.dtype == torch.int64 and keys.shape == values.shape
    assert torch.equal(keys, float_order_key(values))
    assert 0 <= int(keys.min()) and int(keys.max()) < 1 << 32
    numbers = ~torch.isnan(values)
    by_key = values[numbers][torch.argsort(keys[numbers], stable=True)]
    assert (by_key[1:] >= by_key[:-1]).all()
    nan, neg_nan, inf, neg_inf, neg_zero, zero = (fp32_order_key(_floats([b])).item() for b in
                                                  (0x7FC00000, 0xFFC00000, 0x7F800000, 0xFF800000,
                                                   0x80000000, 0x00000000))
    assert neg_nan < neg_inf < neg_zero < zero < inf < nan
    half = values[numbers].bfloat16()
    assert torch.equal(fp32_order_key(half), fp32_order_key(half.float()))
