"""Tensor parallelism emulated in one process: ``N`` ranks as threads, a fake TP group per rank.

:func:`run_ranks` runs ``fn(group)`` for every rank of a :class:`FakeTPGroup` world, each in its
own thread, strictly one at a time: a rank runs until it calls a collective, deposits its input
and hands the turn to the next rank; the last rank computes the collective for everyone (in rank
order) and hands the turn back to rank 0. Execution is therefore sequential and deterministic (the
Triton interpreter and torch see one thread at a time), and every rank sees exactly what a real
group would give it: the all-reduce is the sum of the ranks' tensors, the all-gather their stack.
A rank that raises, or ranks that call different collectives, fail every rank with an error
instead of hanging.
"""

from __future__ import annotations

import threading

import torch

from dsaspec.distributed.tp_group import SYMM_MEM

TIMEOUT_S = 300.0


class _World:
    def __init__(self, size: int):
        self.size = size
        self.cond = threading.Condition()
        self.reset()

    def reset(self) -> None:
        self.turn = 0
        self.completed = 0                # collectives completed so far
        self.deposits: dict[int, tuple] = {}
        self.done: set[int] = set()
        self.error: BaseException | None = None

    def wait_turn(self, rank: int) -> None:
        if not self.cond.wait_for(lambda: self.turn == rank or self.error is not None, TIMEOUT_S):
            self.error = TimeoutError(f"rank {rank} waited {TIMEOUT_S} s for its turn")
            self.cond.notify_all()
        if self.error is not None:
            raise RuntimeError(f"rank {rank}: another rank failed") from self.error

    def pass_turn(self, rank: int) -> None:
        """The turn goes to the next rank that has not finished."""
        for step in range(1, self.size + 1):
            if (rank + step) % self.size not in self.done:
                self.turn = (rank + step) % self.size
                break
        self.cond.notify_all()

    def collective(self, rank: int, op: str, payload: tuple) -> None:
        with self.cond:
            completed = self.completed
            self.deposits[rank] = (op, payload)
            if len(self.deposits) == self.size - len(self.done):
                self._complete()
            self.pass_turn(rank)
            self.wait_turn(rank)
            if self.completed == completed:
                raise RuntimeError(f"rank {rank} called {op} but the other ranks finished without it")

    def _complete(self) -> None:
        ops = {self.deposits.get(r, ("<finished>",))[0] for r in range(self.size)}
        if len(ops) != 1 or len(self.deposits) != self.size:
            raise RuntimeError(f"ranks called different collectives: {ops}")
        op = ops.pop()
        payloads = [self.deposits[r][1] for r in range(self.size)]
        self.deposits.clear()
        self.completed += 1
        if op == "all_reduce":
            total = payloads[0][0].clone()
            for tensor, _ in payloads[1:]:
                total += tensor
            for _, target in payloads:
                target.copy_(total)
        else:
            stacked = torch.stack([local for local, _ in payloads])
            for _, out in payloads:
                out.copy_(stacked)


class FakeTPGroup:
    """One rank of an emulated TP group with the :class:`~dsaspec.distributed.tp_group.TPGroup`
    interface: ``all_reduce`` sums, ``all_gather`` stacks; ``transport`` is symmetric memory (so a
    LogitsProcessor takes the argmax exchange), every all-reduce fits it."""

    process_group = None
    symm_mem_max_bytes = 1 << 40

    def __init__(self, world: _World, rank: int, device="cpu"):
        self.world, self.rank, self.size = world, rank, world.size
        self.device = torch.device(device)
        self.transport = SYMM_MEM
        self._symmetric: set[int] = set()

    def all_reduce_transport(self, nbytes: int, dtype: torch.dtype = torch.float32) -> str:
        return SYMM_MEM

    def symmetric_empty(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        tensor = torch.empty(numel, dtype=dtype, device=self.device)
        self._symmetric.add(tensor.untyped_storage().data_ptr())
        return tensor

    def is_symmetric(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._symmetric

    def all_reduce(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        target = tensor if out is None else out
        assert tensor.is_contiguous() and target.shape == tensor.shape and target.dtype == tensor.dtype
        self.world.collective(self.rank, "all_reduce", (tensor.clone(), target))
        return target

    def all_gather(self, local: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        assert tuple(out.shape) == (self.size, *local.shape) and out.dtype == local.dtype
        self.world.collective(self.rank, "all_gather", (local.clone(), out))
        return out

    def barrier(self) -> None:
        pass


def fake_groups(size: int, device="cpu") -> list[FakeTPGroup]:
    """The ``size`` ranks of one emulated group."""
    world = _World(size)
    return [FakeTPGroup(world, rank, device) for rank in range(size)]


def run_ranks(groups: list[FakeTPGroup], fn) -> list:
    """``[fn(group) for group in groups]``, the ranks run in lockstep (see the module docstring).
    Re-raises the first rank's exception."""
    world = groups[0].world
    world.reset()
    results: list = [None] * len(groups)

    def body(group: FakeTPGroup) -> None:
        try:
            with world.cond:
                world.wait_turn(group.rank)
            results[group.rank] = fn(group)
        except BaseException as err:   # noqa: BLE001 - handed to the caller
            with world.cond:
                if world.error is None:
                    world.error = err
                world.cond.notify_all()
            return
        with world.cond:
            world.done.add(group.rank)
            world.pass_turn(group.rank)

    threads = [threading.Thread(target=body, args=(g,), daemon=True) for g in groups]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S * 2)
    if world.error is not None:
        raise world.error
    if any(thread.is_alive() for thread in threads):
        raise TimeoutError("emulated ranks did not finish")
    return results
