"""A tensor-parallel group over torch.distributed: sum all-reduce, all-gather, and its transport.

Small sum all-reduces run on torch's symmetric-memory one-shot all-reduce
(``torch.ops.symm_mem.one_shot_all_reduce_out``: every rank reads its peers' buffers over P2P, no
NVLink multicast) when it is available, on NCCL otherwise; all-gathers run on NCCL. Both transports
are CUDA-graph capturable: symmetric buffers are allocated and rendezvoused eagerly (in the
constructor or ``symmetric_empty``), never during a capture. ``transport`` says which one the group
uses so callers can decline work that only pays off off NCCL.

NVLink multicast stays off: ``NCCL_NVLS_ENABLE=0`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` are
set (if unset) before any communicator exists, and no ``multimem_*`` op is ever called.

A TP 1 group (``TPGroup.single()``) needs no torch.distributed: its all-reduce is the identity.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

LOCAL = "local"
SYMM_MEM = "symm_mem"
NCCL = "nccl"
DEFAULT_SYMM_MEM_MAX_BYTES = 512 * 1024
_TRANSPORTS = ("auto", SYMM_MEM, NCCL)


def disable_nvlink_multicast() -> None:
    """Set ``NCCL_NVLS_ENABLE=0`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` unless already set."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


def _symm_mem_module():
    """``torch.distributed._symmetric_memory`` if it and the one-shot op exist, else None."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return None
    ops = getattr(torch.ops, "symm_mem", None)
    if ops is None or not hasattr(ops, "one_shot_all_reduce_out"):
        return None
    return symm_mem


class TPGroup:
    """A TP group: ``rank``, ``size``, ``device``, ``transport`` and its collectives.

    Parameters
    ----------
    process_group : torch.distributed ProcessGroup (NCCL), or None for TP 1 without distributed.
    device : the CUDA device of this rank (default: the current CUDA device, or CPU without CUDA).
    transport : ``"auto"`` (symmetric memory when available, else NCCL), ``"symm_mem"`` (raise if
        unavailable) or ``"nccl"``. Ignored at TP 1 (``"local"``).
    symm_mem_max_bytes : largest all-reduce (bytes) sent over symmetric memory; larger ones use NCCL.

    Constructing a group of size > 1 is collective over ``process_group`` (every rank, same order).
    """

    def __init__(self, process_group=None, *, device=None, transport: str = "auto",
                 symm_mem_max_bytes: int = DEFAULT_SYMM_MEM_MAX_BYTES):
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport must be one of {_TRANSPORTS}, got {transport!r}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.device = torch.device(device)
        self.process_group = process_group
        self.size = 1 if process_group is None else process_group.size()
        self.rank = 0 if process_group is None else process_group.rank()
        self.group_name = None if process_group is None else process_group.group_name
        self.symm_mem_max_bytes = symm_mem_max_bytes
        self._symm_mem = None
        self._symmetric_storages: set[int] = set()
        self._staging = None
        if self.size == 1:
            self.transport = LOCAL
            return
        if self.device.type != "cuda":
            raise ValueError(f"a TP group of size {self.size} needs a CUDA device, got {self.device}")
        disable_nvlink_multicast()  # before any symmetric-memory rendezvous (and NCCL communicator, if lazy)
        self.transport = NCCL
        if transport != NCCL:
            ok = self._setup_symmetric_memory()
            # Every rank must use the same transport: agree on the weakest outcome.
            flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=process_group)
            if int(flag.item()) == 1:
                self.transport = SYMM_MEM
            else:
                self._symm_mem = None
                self._staging = None
                if transport == SYMM_MEM:
                    raise RuntimeError("transport='symm_mem' requested but symmetric memory is unavailable "
                                       "on at least one rank of the group")
        else:
            # Create the NCCL communicator eagerly so the first collective may be captured.
            dist.all_reduce(torch.zeros(1, device=self.device), group=process_group)

    @classmethod
    def single(cls, device=None) -> "TPGroup":
        """A TP 1 group without torch.distributed (all-reduce = identity)."""
        return cls(None, device=device)

    def _setup_symmetric_memory(self) -> bool:
        symm_mem = _symm_mem_module()
        if symm_mem is None:
            return False
        try:
            staging = symm_mem.empty(self.symm_mem_max_bytes // 4, dtype=torch.float32, device=self.device)
            self._rendezvous(symm_mem, staging)
        except (RuntimeError, TypeError, ValueError):
            return False
        self._symm_mem = symm_mem
        self._staging = staging
        return True

    def _rendezvous(self, symm_mem, tensor: torch.Tensor) -> None:
        try:
            symm_mem.rendezvous(tensor, self.group_name)
        except RuntimeError:
            # Older torch needs the group registered first (deprecated, a no-op, in newer ones).
            symm_mem.enable_symm_mem_for_group(self.group_name)
            symm_mem.rendezvous(tensor, self.group_name)
        self._symmetric_storages.add(tensor.untyped_storage().data_ptr())

    def all_reduce_transport(self, nbytes: int, dtype: torch.dtype = torch.float32) -> str:
        """Transport a sum all-reduce of ``nbytes`` bytes of ``dtype`` takes: local, symm_mem or nccl."""
        if self.transport != SYMM_MEM:
            return self.transport
        # The one-shot kernel takes fp32/bf16 and sizes that are a multiple of 4 bytes.
        fits = dtype in (torch.float32, torch.bfloat16) and nbytes % 4 == 0 and nbytes <= self.symm_mem_max_bytes
        return SYMM_MEM if fits else NCCL

    def symmetric_empty(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A ``[numel]`` buffer that ``all_reduce`` reads without staging (zero-copy).

        Collective over the group when the transport is symmetric memory (same order on every rank);
        call it eagerly, before any CUDA-graph capture. Otherwise a plain ``torch.empty``.
        """
        if self.transport != SYMM_MEM:
            return torch.empty(numel, dtype=dtype, device=self.device)
        tensor = self._symm_mem.empty(numel, dtype=dtype, device=self.device)
        self._rendezvous(self._symm_mem, tensor)
        return tensor

    def is_symmetric(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in a buffer from ``symmetric_empty`` (or the staging buffer)."""
        return tensor.untyped_storage().data_ptr() in self._symmetric_storages

    def all_reduce(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum over the group: ``out = sum_r tensor_r`` (``out`` defaults to ``tensor``, in place).

        Over symmetric memory, a ``tensor`` from ``symmetric_empty`` is read in place by the peers
        (then ``out`` must be another tensor); any other tensor is staged into the group's
        symmetric buffer first. Capturable in a CUDA graph.

        Parameters
        ----------
        tensor : Tensor, contiguous, on ``device``.
        out : optional Tensor, same shape and dtype, contiguous; written.

        Returns
        -------
        ``out`` (or ``tensor``).
        """
        target = tensor if out is None else out
        if out is not None and (out.shape != tensor.shape or out.dtype != tensor.dtype or not out.is_contiguous()):
            raise ValueError(f"out must be contiguous {tuple(tensor.shape)} {tensor.dtype}, got "
                             f"{tuple(out.shape)} {out.dtype}")
        if not tensor.is_contiguous():
            raise ValueError("all_reduce needs a contiguous tensor")
        if self.transport == LOCAL:
            if target is not tensor:
                target.copy_(tensor)
            return target
        if self.all_reduce_transport(tensor.numel() * tensor.element_size(), tensor.dtype) == SYMM_MEM:
            if self.is_symmetric(tensor):
                if target.data_ptr() == tensor.data_ptr():
                    raise ValueError("a symmetric-memory input is read by the peers: pass a different out=")
                source = tensor
            else:
                source = self._staging.view(tensor.dtype)[:tensor.numel()]
                source.copy_(tensor.view(-1))
            torch.ops.symm_mem.one_shot_all_reduce_out(source.view(-1), "sum", self.group_name, target.view(-1))
            return target
        if target is not tensor:
            target.copy_(tensor)
        dist.all_reduce(target, group=self.process_group)
        return target

    def all_gather(self, local: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Stack every rank's ``local`` along a new leading dim: ``out[r] = local_r`` (NCCL).

        Parameters
        ----------
        local : Tensor ``[...]``, contiguous.
        out : Tensor ``[size, ...]``, same dtype, contiguous; written.

        Returns
        -------
        ``out``.
        """
        if tuple(out.shape) != (self.size, *local.shape) or out.dtype != local.dtype or not out.is_contiguous():
            raise ValueError(f"out must be contiguous [{self.size}, {', '.join(map(str, local.shape))}] "
                             f"{local.dtype}, got {tuple(out.shape)} {out.dtype}")
        if self.transport == LOCAL:
            out[0].copy_(local)
            return out
        # Flat views: the concatenated form every backend accepts.
        dist.all_gather_into_tensor(out.view(-1), local.contiguous().view(-1), group=self.process_group)
        return out

    def barrier(self) -> None:
        """Wait for every rank of the group (no-op at TP 1)."""
        if self.process_group is not None:
            dist.barrier(group=self.process_group, device_ids=[self.device.index])


def init_distributed(timeout_s: float = 300.0) -> bool:
    """Initialise torch.distributed (NCCL) from torchrun's environment; False when not under torchrun.

    Sets the CUDA device to ``LOCAL_RANK`` and disables NVLink multicast first.
    """
    if dist.is_available() and dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    disable_nvlink_multicast()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank),
                            timeout=datetime.timedelta(seconds=timeout_s))
    return True


def init_tp_group(*, transport: str = "auto", symm_mem_max_bytes: int = DEFAULT_SYMM_MEM_MAX_BYTES) -> TPGroup:
    """The TP group over every torchrun rank, or a TP 1 group when not launched by torchrun.

    Collective when distributed (call it on every rank).
    """
    if not init_distributed():
        return TPGroup.single()
    return TPGroup(dist.group.WORLD, device=torch.device("cuda", torch.cuda.current_device()),
                   transport=transport, symm_mem_max_bytes=symm_mem_max_bytes)
