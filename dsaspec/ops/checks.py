"""Argument checks shared by the op wrappers and the runtime's allocators: host-side only (counts,
shape, dtype, device, strides), except :func:`check_live_width`, which reads the lengths on the
host and so stays out of graphs."""

from __future__ import annotations

import torch


def check_count(name: str, value, minimum: int = 1) -> None:
    """Raise a ``TypeError`` naming ``name`` unless ``value`` is an int (not a bool), a
    ``ValueError`` unless it is at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name}: expected >= {minimum}, got {value}")


def check_tensor(name: str, tensor, *, dtype: torch.dtype | tuple[torch.dtype, ...], shape: tuple | None = None,
                 device: torch.device | None = None, ndim: int | None = None,
                 contiguous_last: bool = True) -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``tensor`` has the expected dtype (or one of a
    tuple of dtypes), shape
    (entries ``None`` match anything), device and (with ``contiguous_last``) a contiguous last
    dimension; a ``TypeError`` unless it is a tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if isinstance(dtype, tuple):
        if tensor.dtype not in dtype:
            raise ValueError(f"{name}: expected dtype in {dtype}, got {tensor.dtype}")
    elif tensor.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {tensor.dtype}")
    if ndim is None and shape is not None:
        ndim = len(shape)
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if shape is not None and any(want is not None and want != got
                                 for want, got in zip(shape, tensor.shape)):
        expected = tuple("*" if want is None else want for want in shape)
        raise ValueError(f"{name}: expected shape {expected}, got {tuple(tensor.shape)}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name}: expected device {device}, got {tensor.device}")
    if contiguous_last and tensor.dim() > 0 and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), "
                         f"got strides {tensor.stride()}")


def check_live_width(seqlens: torch.Tensor, **widths: torch.Tensor) -> None:
    """Raise a ``ValueError`` naming the tensor when the longest row of ``seqlens`` (a host sync)
    does not fit in the last dimension of any of ``widths`` (``name=tensor``)."""
    if seqlens.numel() == 0:
        return
    longest = int(seqlens.max())
    for name, tensor in widths.items():
        if longest > tensor.shape[-1]:
            raise ValueError(f"{name}: width {tensor.shape[-1]} is smaller than the longest row "
                             f"({longest} live tokens)")
