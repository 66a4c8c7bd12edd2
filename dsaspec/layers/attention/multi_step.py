"""MTP draft decode: ``S - 1`` step backends with identical decode metadata, written in one launch.

The draft chain of ``num_steps`` S runs ``S - 1`` forwards, each with its own
:class:`~dsaspec.layers.attention.backend.DSAAttnBackend` ("step backend"). DSA gives every step the
same DECODE metadata, computed from the same committed ``seq_lens`` (no per-step offset). Per
captured batch bucket the multi-step backend picks one of three ways to write it (:meth:`path`):

- ``one_launch`` (new): one bounded launch writes every step backend's graph buffers straight from
  ``req_to_token`` (up to 4 destinations per launch, more step backends take further launches); no
  scratch. Needs every step backend on the bounded kernels and matching tables (same
  ``req_to_token``, W, P, index_topk, buffer shapes and dtypes).
- ``precompute_and_copy`` (what engines do today; ``bounded_metadata=False`` restores it): the
  context-wide decode kernel writes a ``[bs, W]`` scratch, which is then copied whole into every
  step backend (one 3-destination copy for the first three, one copy per further one; one copy
  each below three).
- ``per_step``: the tables do not match, so no single write can serve them (or the baseline's
  whole-buffer copy cannot, because the page-table rows are padded): every step backend writes its
  own metadata with its own kernel.

Indexer schedules: on the baseline every step backend refreshes its schedule. With ``bounded_metadata``
on, only step backends that run the indexer refresh: none when the draft steps are seeded with the
draft-extend top-k (IndexShare), step 0 when IndexShare runs unseeded (the later steps reuse its
top-k), every step without IndexShare.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dsaspec.layers.attention.backend import BOUNDED, DEFAULT_BUCKETS, DSAAttnBackend, check_index_tensor
from dsaspec.ops.dsa_metadata_common import MetadataBuffers
from dsaspec.forward_mode import Mode
from dsaspec.ops.baseline.draft_decode_metadata import precompute_and_copy
from dsaspec.ops.draft_decode_metadata import draft_decode_metadata

ONE_LAUNCH = "one_launch"
PRECOMPUTE_AND_COPY = "precompute_and_copy"
PER_STEP = "per_step"


def steps_running_indexer(num_step_backends: int, *, index_share: bool, seeded: bool) -> tuple[int, ...]:
    """Indices of the draft step backends whose forward runs the indexer.

    IndexShare seeded with the draft-extend top-k: none. IndexShare unseeded (warm-up, no seed):
    step 0, whose top-k the later steps reuse. No IndexShare: every step.
    """
    if index_share:
        return () if seeded else (0,)
    return tuple(range(num_step_backends))


def unique_by_identity(items: Sequence) -> list:
    """``items`` without repeats of the same object, first occurrence order."""
    seen: set[int] = set()
    return [x for x in items if not (id(x) in seen or seen.add(id(x)))]


def tables_match(step_backends: Sequence[DSAAttnBackend], bs: int) -> tuple[bool, str]:
    """Whether one write can serve every step backend's decode buffers of bucket ``bs``:
    same ``req_to_token`` tensor, index_topk, page size, and buffer shapes/dtypes/devices."""
    first = step_backends[0]
    first_buf = first.buffers(bs, Mode.DECODE)
    table = first.req_to_token
    for i, step in enumerate(step_backends[1:], start=1):
        other = step.req_to_token
        if (other.data_ptr(), other.shape, other.stride()) != (table.data_ptr(), table.shape, table.stride()):
            return False, f"step backend {i} reads a different req_to_token than step backend 0"
        for name in ("index_topk", "page_size"):
            if getattr(step, name) != getattr(first, name):
                return False, (f"step backend {i} has {name}={getattr(step, name)}, "
                               f"step backend 0 {getattr(first, name)}")
        buf = step.buffers(bs, Mode.DECODE)
        mine, theirs = buf.tensors(), first_buf.tensors()
        if not buf.same_layout(first_buf) or [t.dtype for t in mine] != [t.dtype for t in theirs]:
            return False, f"step backend {i}'s buffers differ from step backend 0's in shape or dtype"
    return True, "tables match"


class DSAMultiStepDraftBackend:
    """Decode metadata of the ``S - 1`` draft step backends of an MTP / EAGLE chain.

    Parameters
    ----------
    step_backends : the step backends, one per draft forward (they should share one
        ``req_to_token``; see :func:`tables_match`).
    index_share : the draft steps reuse one top-k (GLM-5.x IndexShare) instead of each running the
        indexer.
    share_buffers : all step backends alias step backend 0's buffer set (and schedule); the one
        launch is then a single-destination write.
    bounded_metadata : the one-launch path may be taken (``RuntimeOptions.bounded_replay_metadata``);
        False: precompute + copies, the schedules of every step refreshed.

    Build the usual configuration with :meth:`create`.
    """

    def __init__(self, step_backends: Sequence[DSAAttnBackend], *, index_share: bool = True,
                 share_buffers: bool = False, bounded_metadata: bool = True):
        if len(step_backends) < 1:
            raise ValueError("step_backends: at least one step backend is required")
        self.step_backends = list(step_backends)
        self.index_share = index_share
        self.share_buffers = share_buffers
        self.bounded_metadata = bool(bounded_metadata)
        self.skip_unused_schedules = self.bounded_metadata
        self._paths: dict[int, tuple[str, str]] = {}
        self._scratch: dict[int, MetadataBuffers] = {}

    @classmethod
    def create(cls, req_to_token: torch.Tensor, *, num_steps: int, index_topk: int, page_size: int = 64,
               bucket_sizes: Sequence[int] = DEFAULT_BUCKETS, index_share: bool = True,
               share_buffers: bool = False, bounded_metadata: bool = True,
               **backend_kwargs) -> "DSAMultiStepDraftBackend":
        """``num_steps - 1`` step backends over ``req_to_token`` (3 for EAGLE 4/1/5, 4 for 5/1/6);
        ``backend_kwargs`` go to every :class:`DSAAttnBackend` (num_sms, budget, force_kernel, ...)."""
        if num_steps < 2:
            raise ValueError(f"num_steps must be >= 2 (the draft decode has num_steps - 1 step backends), got {num_steps}")
        steps = [DSAAttnBackend(req_to_token, index_topk=index_topk, page_size=page_size,
                                bucket_sizes=bucket_sizes, bounded_metadata=bounded_metadata, **backend_kwargs)
                 for _ in range(num_steps - 1)]
        return cls(steps, index_share=index_share, share_buffers=share_buffers, bounded_metadata=bounded_metadata)

    @property
    def num_step_backends(self) -> int:
        return len(self.step_backends)

    def capture(self, bs: int) -> list[MetadataBuffers]:
        """Capture the decode buffers of bucket ``bs`` in every step backend, decide the path of
        ``bs`` (see :meth:`path`) and, on the baseline path, allocate the ``[bs, W]`` scratch.
        Returns the step backends' buffers in step order."""
        first = self.step_backends[0]
        first.capture(bs, Mode.DECODE)
        for step in self.step_backends[1:]:
            step.capture(bs, Mode.DECODE, share_from=first if self.share_buffers else None)
        if bs not in self._paths:
            matched, why = tables_match(self.step_backends, bs)
            not_bounded = [i for i, s in enumerate(self.step_backends) if s.kernel != BOUNDED]
            if not matched:
                self._paths[bs] = (PER_STEP, why)
            elif not_bounded and not all(t.is_contiguous() for t in first.buffers(bs, Mode.DECODE).tensors()):
                self._paths[bs] = (PER_STEP, f"step backend {not_bounded[0]} uses the context-wide kernels and "
                                   "the page-table rows are padded (row_align): the whole-buffer copy needs "
                                   "contiguous tables")
            elif not_bounded:
                i = not_bounded[0]
                self._paths[bs] = (PRECOMPUTE_AND_COPY, f"step backend {i} uses the context-wide "
                                   f"kernels: {self.step_backends[i].kernel_reason}")
            else:
                self._paths[bs] = (ONE_LAUNCH, "every step backend bounded and the tables match")
            if self._paths[bs][0] == PRECOMPUTE_AND_COPY:
                self._scratch[bs] = MetadataBuffers.allocate(Mode.DECODE, bs, first.width, first.page_size,
                                                             first.device)
        return [step.buffers(bs, Mode.DECODE) for step in self.step_backends]

    def path(self, bs: int) -> str:
        """How bucket ``bs`` writes its metadata: ``one_launch``, ``precompute_and_copy`` or
        ``per_step`` (decided once, at :meth:`capture`)."""
        return self._decision(bs)[0]

    def path_reason(self, bs: int) -> str:
        """Why :meth:`path` chose what it did for bucket ``bs``."""
        return self._decision(bs)[1]

    def _decision(self, bs: int) -> tuple[str, str]:
        try:
            return self._paths[bs]
        except KeyError:
            raise ValueError(f"bs={bs} was not captured by the multi-step backend "
                             f"(captured: {sorted(self._paths)}); call capture(bs) first") from None

    def schedule_refresh_steps(self, seeded: bool) -> tuple[int, ...]:
        """Step backends whose indexer schedule :meth:`replay` refreshes: every one with the kill
        switch off (the baseline), else those that run the indexer (:func:`steps_running_indexer`)."""
        if not self.skip_unused_schedules:
            return tuple(range(self.num_step_backends))
        return steps_running_indexer(self.num_step_backends, index_share=self.index_share, seeded=seeded)

    def replay(self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, *,
               seeded: bool = False, check_values: bool = False) -> list[MetadataBuffers]:
        """Write the decode metadata of a ``bs``-bucket batch into every step backend's static
        buffers, then refresh the schedules of :meth:`schedule_refresh_steps` (``seeded``: the draft
        steps carry the draft-extend top-k).

        ``req_pool_indices``, ``seq_lens``: int32/int64 ``[bs]`` (committed lengths; padded rows 1).
        Writes each step backend's decode buffers of ``bs`` (live prefix of the page tables, every
        1-D output), the scratch on the baseline path, and the refreshed schedules. No host sync
        unless ``check_values`` (the kernels' precondition checks, see
        :meth:`DSAAttnBackend.write_metadata`). Returns the buffers in step order.
        """
        path = self.path(bs)
        steps = self.step_backends
        outs = [step.buffers(bs, Mode.DECODE) for step in steps]
        if path == PER_STEP:
            for step in steps:
                step.replay(bs, req_pool_indices, seq_lens, Mode.DECODE, refresh_schedule=False,
                            check_values=check_values)
        else:
            first = steps[0]
            check_index_tensor("req_pool_indices", req_pool_indices, bs, first.device)
            check_index_tensor("seq_lens", seq_lens, bs, first.device)
            kwargs = dict(index_topk=first.index_topk, page_size=first.page_size, check_values=check_values)
            if path == ONE_LAUNCH:
                draft_decode_metadata(first.req_to_token, req_pool_indices, seq_lens, unique_by_identity(outs),
                                      budget=first.budget, **kwargs)
            else:
                precompute_and_copy(first.req_to_token, req_pool_indices, seq_lens, self._scratch[bs],
                                    unique_by_identity(outs), **kwargs)
        refreshed: list[torch.Tensor] = []
        for i in self.schedule_refresh_steps(seeded):
            schedule = steps[i].schedule(bs, Mode.DECODE)
            if not any(schedule is done for done in refreshed):
                steps[i].refresh_schedule(bs, Mode.DECODE)
                refreshed.append(schedule)
        return outs
