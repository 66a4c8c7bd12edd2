"""The device facts the op wrappers size their launches by, and what kernels share on the device: the
chained-launch entry (``enter_chain`` / ``wait_in_chain``) and the split launches' arrival counters."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

H200_SMS = 132  # used off-GPU where the interpreter should take the H200's launch shapes
SM_REGISTERS, THREAD_REGISTERS = 65536, 255  # 32-bit registers of one SM and of one thread (sm_80 .. sm_90)
COUNTER_CAPACITY = 1 << 20   # arrival counters per device: the output tiles of one split launch


def sm_count(device: torch.device | str, without_cuda: int = H200_SMS) -> int:
    """Streaming multiprocessors of ``device`` if it is a CUDA device, else ``without_cuda``."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return without_cuda


def resident_registers(programs_per_sm: int, num_warps: int) -> int:
    """The most registers a thread may hold (a ``maxnreg`` cap) for ``programs_per_sm`` programs of
    ``num_warps`` warps to be resident on one SM at once: the SM's 65,536 over their threads, in the
    allocation unit 8, at most a thread's 255."""
    return min(SM_REGISTERS // (programs_per_sm * num_warps * 32) // 8 * 8, THREAD_REGISTERS)


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


@triton.jit
def enter_chain(CHAINED: tl.constexpr):
    # A chained kernel (launched with launch_pdl=True where supports_pdl) may start while the kernel before it in the
    # stream is still running, so it waits for that grid to finish (its writes visible) before it
    # touches memory, then lets the kernel after it launch: each launch and program start overlaps
    # the kernel before instead of following its end. Call first in the kernel, in every program.
    if CHAINED:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def wait_in_chain(CHAINED: tl.constexpr):
    # enter_chain without the early release: the kernel after this one launches as this one's programs
    # exit, not as they start, so its waiting programs take no SM slots this kernel's later programs need.
    if CHAINED:
        gdc_wait()


_counters: dict[torch.device, torch.Tensor] = {}


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The device's int32 arrival counters (``COUNTER_CAPACITY``, all 0 between launches: each
    launch's last arrival at a counter stores 0 back, :func:`last_to_arrive`), shared by every split
    launch (a launch waits for the one before it in the stream, so they never overlap); ``tiles``
    (the counters a launch uses) is checked against the capacity. The first call on a device
    allocates them, which CUDA-graph capture does not allow: it raises there."""
    if tiles > COUNTER_CAPACITY:
        raise ValueError(f"a split launch of {tiles} output tiles exceeds the {COUNTER_CAPACITY} tile "
                         "counters; use a configuration without the split or fewer rows")
    counters = _counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the split tile counters are allocated (zeroed) on the first split call "
                               f"on {device}; make one call outside CUDA-graph capture first")
        counters = torch.zeros(COUNTER_CAPACITY, dtype=torch.int32, device=device)
        _counters[device] = counters
    return counters


@triton.jit
def last_to_arrive(counter_ptr, arrivals):
    """Called by each of the ``arrivals`` programs sharing ``counter_ptr`` (a :func:`tile_counters`
    entry) once it has stored its partial: whether it is the last to arrive, which may then read
    every program's partial (acquire-release at GPU scope; loads ``.cg``, past L1) and which stores
    0 back for the next launch."""
    tl.debug_barrier()  # every thread's stores are issued before the release
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == arrivals - 1
    if last:
        tl.store(counter_ptr, 0)
    return last
