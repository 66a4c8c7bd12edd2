"""The device facts the op wrappers size their launches by."""

from __future__ import annotations

import torch

H200_SMS = 132  # used off-GPU where the interpreter should take the H200's launch shapes


def sm_count(device: torch.device | str, without_cuda: int = H200_SMS) -> int:
    """Streaming multiprocessors of ``device`` if it is a CUDA device, else ``without_cuda``."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return without_cuda


def interpreted(kernel) -> bool:
    """Whether ``kernel`` (a ``triton.jit`` function) runs under the Triton interpreter
    (``TRITON_INTERPRET=1`` when triton was imported, also with CUDA tensors)."""
    import triton

    return not isinstance(kernel, triton.runtime.JITFunction)


def supports_pdl(device: torch.device | str) -> bool:
    """Whether kernels on ``device`` may use programmatic dependent launch (``griddepcontrol``,
    Triton's ``launch_pdl``): a CUDA device of compute capability 9.0 (Hopper) or newer."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
