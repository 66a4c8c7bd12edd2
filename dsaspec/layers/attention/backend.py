"""DSA attention metadata backend: static graph buffers per (batch bucket, mode), replay, eager,
and the :class:`~dsaspec.layers.attention.inputs.AttentionInputs` the forwards read over them.

One :class:`DSAAttnBackend` serves one ``req_to_token`` table. For every captured batch bucket and
forward mode (decode, target verify, draft extend) it owns the static metadata buffers
(:class:`~dsaspec.ops.dsa_metadata_common.MetadataBuffers`) and a static indexer schedule, allocated once
by :meth:`~DSAAttnBackend.capture`. :meth:`~DSAAttnBackend.replay` writes new metadata into them
(never rebinding them, never syncing the host), so a CUDA graph captured over them stays valid.
Batches above the largest bucket go through :meth:`~DSAAttnBackend.eager`, whose buffers are only
as wide as the longest live row.

Kernel selection (:attr:`DSAAttnBackend.kernel`, with :attr:`DSAAttnBackend.kernel_reason`): the
live-bounded kernels when ``req_to_token`` is on CUDA and ``bounded_metadata`` is on;
the context-wide kernels (what engines run today) otherwise. dsaspec implements no kpool-aware
metadata (``dsa_cache_seqlens`` is ``min(L, index_topk)``), so ``index_kpool > 1`` and kpool
metadata fusion are rejected at construction instead of getting lengths that are not kpool-aware.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dsaspec.layers.attention.inputs import AttentionInputs, AttentionScratch, AttentionWorkspace
from dsaspec.ops.baseline.dsa_metadata import context_wide_metadata
from dsaspec.ops.dsa_metadata_common import MetadataBuffers
from dsaspec.forward_mode import Mode
from dsaspec.ops.dsa_metadata import DEFAULT_BUDGET, bounded_metadata
from dsaspec.ops.indexer_schedule import INDEXER_BLOCK_KV, indexer_programs, indexer_schedule

BOUNDED = "bounded"
CONTEXT_WIDE = "context_wide"
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)


def as_mode(mode: Mode | str) -> Mode:
    """``mode`` as a :class:`Mode`; a clear error naming the accepted values otherwise."""
    try:
        return Mode(mode)
    except ValueError:
        accepted = ", ".join(m.value for m in Mode)
        raise ValueError(f"mode must be one of {accepted}; got {mode!r}") from None


def select_kernel(*, on_cuda: bool, bounded_enabled: bool) -> tuple[str, str]:
    """Which metadata kernels a backend uses, and why: ``(BOUNDED | CONTEXT_WIDE, reason)``.

    Bounded iff ``on_cuda and bounded_enabled``.
    """
    if not bounded_enabled:
        return CONTEXT_WIDE, "bounded_metadata=False (DSASPEC_BOUNDED_REPLAY_METADATA=0)"
    if not on_cuda:
        return CONTEXT_WIDE, "req_to_token is not on a CUDA device"
    return BOUNDED, "CUDA and bounded_metadata on"


def check_index_tensor(name: str, t: torch.Tensor, batch: int, device: torch.device) -> None:
    """Raise unless ``t`` is an int32/int64 ``[batch]`` tensor on ``device`` (no host sync)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be an int32/int64 tensor [{batch}], got {got}")
    if t.shape[0] != batch:
        raise ValueError(f"{name} has {t.shape[0]} entries, expected {batch} (one per request; "
                         f"graph replays pad the live batch up to the bucket)")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, req_to_token on {device}")


class DSAAttnBackend:
    """Static DSA replay metadata of one ``req_to_token`` table, per batch bucket and mode.

    Parameters
    ----------
    req_to_token : int32 ``[pool, W]`` token-to-KV-slot table (read, never written).
    index_topk : K, the indexer top-k (``dsa_cache_seqlens = min(L, K)``).
    page_size : P, real page size (64); 1 means no ``real_page_table``.
    num_draft_tokens : N, rows per request in target verify and draft extend.
    bucket_sizes : captured batch buckets; :meth:`capture` accepts only these.
    index_kpool, kpool_metadata_fusion : kpool geometry. Not implemented: anything but
        ``index_kpool=1`` and ``kpool_metadata_fusion=False`` raises (the metadata written here is
        not kpool-aware).
    num_sms : indexer programs the schedule splits the KV blocks over (default
        ``indexer_programs``: three per SM, 12 off-GPU); the schedule buffers are
        ``[num_sms + 1, 2]``.
    group_num_sms : the same for the schedules of grouped rows (target verify with
        ``group_verify_rows``), whose indexer configuration may run fewer programs an SM
        (``default_indexer_programs``); None: ``num_sms``.
    budget : program budget of the bounded kernels (``RuntimeOptions.metadata_program_budget``; None:
        ``DEFAULT_BUDGET``); fixed
        here because the bounded grid depends on it and must not change between capture and replay.
    bounded_metadata : the live-bounded kernels may be selected (``RuntimeOptions.bounded_replay_metadata``);
        False: the context-wide baseline.
    row_align : the static page tables' rows are padded to a multiple of this many columns
        (``MetadataBuffers.allocate``; 4 = 16-byte aligned rows, a tuning knob of the bounded kernel).
    force_kernel : for tests and benchmarks only: ``"bounded"`` or ``"context_wide"`` overrides the
        selection (e.g. to run the bounded kernels under the CPU interpreter).
    group_verify_rows : the indexer reads each key block once for the N target-verify rows of a
        request (its schedule and logits use ``rows_per_group = N``); False keeps every row on its
        own, whose logits are then bitwise those of the same position in a decode step (the
        row-invariant mode needs that).

    The indexer schedules skip the rows whose live length is at most ``index_topk`` (their top-k
    is every live position: no indexer logits are needed).
    """

    def __init__(self, req_to_token: torch.Tensor, *, index_topk: int, page_size: int = 64,
                 num_draft_tokens: int = 1, bucket_sizes: Sequence[int] = DEFAULT_BUCKETS,
                 index_kpool: int = 1, kpool_metadata_fusion: bool = False,
                 num_sms: int | None = None, group_num_sms: int | None = None,
                 budget: int | None = None, row_align: int = 1,
                 force_kernel: str | None = None, group_verify_rows: bool = True,
                 bounded_metadata: bool = True):
        if not isinstance(req_to_token, torch.Tensor) or req_to_token.dim() != 2 or req_to_token.dtype != torch.int32:
            got = (f"{req_to_token.dtype} {tuple(req_to_token.shape)}" if isinstance(req_to_token, torch.Tensor)
                   else type(req_to_token).__name__)
            raise ValueError(f"req_to_token must be an int32 tensor [pool, W], got {got}")
        for name, value in (("index_topk", index_topk), ("page_size", page_size),
                            ("num_draft_tokens", num_draft_tokens), ("index_kpool", index_kpool)):
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if index_kpool != 1:
            raise ValueError(f"index_kpool={index_kpool}: kpool-aware metadata is not implemented "
                             "(dsa_cache_seqlens would be min(L, index_topk), not kpool-aware); use index_kpool=1")
        if kpool_metadata_fusion:
            raise ValueError("kpool_metadata_fusion=True: kpool metadata fusion is not implemented")
        buckets = tuple(sorted(set(int(b) for b in bucket_sizes)))
        if not buckets or buckets[0] < 1:
            raise ValueError(f"bucket_sizes must be non-empty positive integers, got {tuple(bucket_sizes)}")
        if force_kernel not in (None, BOUNDED, CONTEXT_WIDE):
            raise ValueError(f"force_kernel must be None, {BOUNDED!r} or {CONTEXT_WIDE!r}, got {force_kernel!r}")
        if num_sms is None:
            num_sms = indexer_programs(req_to_token.device)
        if group_num_sms is None:
            group_num_sms = num_sms
        for name, value in (("num_sms", num_sms), ("group_num_sms", group_num_sms)):
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.req_to_token = req_to_token
        self.index_topk = int(index_topk)
        self.page_size = int(page_size)
        self.num_draft_tokens = int(num_draft_tokens)
        self.bucket_sizes = buckets
        self.num_sms = int(num_sms)
        self.group_num_sms = int(group_num_sms)
        self.budget = DEFAULT_BUDGET if budget is None else int(budget)
        if int(row_align) != row_align or row_align < 1:
            raise ValueError(f"row_align must be an integer >= 1, got {row_align!r}")
        self.row_align = int(row_align)
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        if force_kernel is None:
            self.kernel, self.kernel_reason = select_kernel(
                on_cuda=req_to_token.is_cuda, bounded_enabled=bounded_metadata)
        else:
            self.kernel, self.kernel_reason = force_kernel, f"force_kernel={force_kernel!r} (tests/benchmarks only)"
        self.group_verify_rows = group_verify_rows
        self._buffers: dict[tuple[int, Mode], MetadataBuffers] = {}
        self._schedules: dict[tuple[int, Mode], torch.Tensor] = {}

    @property
    def width(self) -> int:
        """W, the page-table width (``req_to_token.shape[1]``)."""
        return self.req_to_token.shape[1]

    @property
    def device(self) -> torch.device:
        return self.req_to_token.device

    def bucket_for(self, batch: int) -> int | None:
        """Smallest bucket holding ``batch`` requests, or ``None`` above the largest (use :meth:`eager`)."""
        return next((b for b in self.bucket_sizes if b >= batch), None)

    def capture(self, bs: int, mode: Mode | str, *, share_from: "DSAAttnBackend | None" = None) -> MetadataBuffers:
        """Allocate the static buffers and schedule of ``(bs, mode)`` once (zeroed) and return them.

        A second call returns the same buffers. ``share_from``: alias that backend's buffers and
        schedule of ``(bs, mode)`` instead of allocating (the multi-step shared-buffer option); it
        must have captured them and have the same table geometry.
        """
        mode = as_mode(mode)
        if bs not in self.bucket_sizes:
            raise ValueError(f"bs={bs} is not a batch bucket of this backend {self.bucket_sizes}")
        key = (bs, mode)
        if key in self._buffers:
            return self._buffers[key]
        if share_from is not None:
            if share_from.req_to_token.data_ptr() != self.req_to_token.data_ptr():
                raise ValueError("share_from reads a different req_to_token: cannot alias its buffers")
            for name in ("width", "page_size", "num_draft_tokens", "index_topk", "num_sms", "group_num_sms",
                         "device"):
                if getattr(share_from, name) != getattr(self, name):
                    raise ValueError(f"share_from has {name}={getattr(share_from, name)}, this backend "
                                     f"{getattr(self, name)}: cannot alias its buffers")
            self._buffers[key] = share_from.buffers(bs, mode)
            self._schedules[key] = share_from.schedule(bs, mode)
        else:
            self._buffers[key] = MetadataBuffers.allocate(mode, bs, self.width, self.page_size, self.device,
                                                          num_draft_tokens=self.num_draft_tokens,
                                                          row_align=self.row_align)
            self._schedules[key] = torch.zeros(self.programs(mode) + 1, 2, dtype=torch.int32, device=self.device)
        return self._buffers[key]

    def _lookup(self, store: dict, bs: int, mode: Mode | str):
        mode = as_mode(mode)
        try:
            return store[(bs, mode)]
        except KeyError:
            captured = sorted(b for b, m in self._buffers if m is mode)
            if bs > self.bucket_sizes[-1]:
                hint = f"bs={bs} is above the largest bucket {self.bucket_sizes[-1]}: use eager()"
            else:
                hint = "call capture(bs, mode) first"
            raise ValueError(f"bs={bs} was not captured for {mode.value} (captured: {captured}); {hint}") from None

    def buffers(self, bs: int, mode: Mode | str) -> MetadataBuffers:
        """The static buffers of ``(bs, mode)``; a clear error if they were not captured."""
        return self._lookup(self._buffers, bs, mode)

    def schedule(self, bs: int, mode: Mode | str) -> torch.Tensor:
        """The static int32 ``[programs(mode) + 1, 2]`` indexer schedule of ``(bs, mode)``."""
        return self._lookup(self._schedules, bs, mode)

    def attention_inputs(self, bs: int, mode: Mode | str, *, scratch: AttentionScratch | None = None,
                         workspace: AttentionWorkspace | None = None) -> AttentionInputs:
        """The :class:`AttentionInputs` of the forwards of a ``bs``-bucket batch in ``mode`` (call
        at capture, after :meth:`capture`): views of the static buffers of ``(bs, mode)``
        (``page_table_1``, ``seqlens_expanded``), its schedule and :meth:`rows_per_group`. The
        indexer scratch (logits fp32 ``[R, W]``, selected slots int32 ``[R, index_topk]``) is
        allocated here, or the leading rows of ``scratch`` (phases that never run at the same time
        share one); ``workspace``: the Triton ops' workspaces of these ``R`` rows."""
        return AttentionInputs.from_metadata(self.buffers(bs, mode), self.schedule(bs, mode), self.index_topk,
                                             scratch=scratch, rows_per_group=self.rows_per_group(mode),
                                             workspace=workspace)

    def eager_attention_inputs(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                               mode: Mode | str) -> AttentionInputs:
        """The :class:`AttentionInputs` of any batch, over fresh :meth:`eager` metadata and schedule
        (reads the lengths on the host; no graph), with a fresh indexer scratch."""
        metadata, schedule = self.eager(req_pool_indices, seq_lens, mode)
        return AttentionInputs.from_metadata(metadata, schedule, self.index_topk,
                                             rows_per_group=self.rows_per_group(mode))

    def write_metadata(self, mode: Mode | str, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                       out: MetadataBuffers, extend_seq_lens: torch.Tensor | None = None, *,
                       check_values: bool = False, req_to_token: torch.Tensor | None = None) -> MetadataBuffers:
        """Write the ``mode`` metadata of the batch into ``out`` with the selected kernel.

        ``req_to_token`` overrides the table (the eager path passes a column prefix of it).
        ``check_values`` runs the kernels' precondition checks, which read device data (not
        graph-safe); the preconditions, and what the kernels do when they are violated unchecked,
        are in :func:`~dsaspec.ops.dsa_metadata.bounded_metadata`.
        """
        table = self.req_to_token if req_to_token is None else req_to_token
        kwargs = dict(index_topk=self.index_topk, page_size=self.page_size, num_draft_tokens=self.num_draft_tokens,
                      extend_seq_lens=extend_seq_lens, check_values=check_values)
        if self.kernel == BOUNDED:
            bounded_metadata(mode, table, req_pool_indices, seq_lens, out, budget=self.budget, **kwargs)
        else:
            context_wide_metadata(mode, table, req_pool_indices, seq_lens, out, **kwargs)
        return out

    def rows_per_group(self, mode: Mode | str) -> int:
        """The indexer's ``rows_per_group`` in ``mode``: N for target verify when
        ``group_verify_rows``, else 1."""
        grouped = self.group_verify_rows and as_mode(mode) is Mode.TARGET_VERIFY
        return self.num_draft_tokens if grouped else 1

    def programs(self, mode: Mode | str) -> int:
        """Indexer programs (schedule entries) in ``mode``: ``group_num_sms`` where rows are
        grouped (:meth:`rows_per_group` > 1), else ``num_sms``."""
        return self.group_num_sms if self.rows_per_group(mode) > 1 else self.num_sms

    def _write_schedule(self, seqlens: torch.Tensor, mode: Mode, out: torch.Tensor) -> torch.Tensor:
        return indexer_schedule(seqlens, self.programs(mode), out, block_kv=INDEXER_BLOCK_KV, skip_len=self.index_topk,
                                rows_per_group=self.rows_per_group(mode))

    def refresh_schedule(self, bs: int, mode: Mode | str) -> torch.Tensor:
        """Rewrite the static indexer schedule of ``(bs, mode)`` from its buffers' row context
        lengths (``seqlens_expanded``; decode: ``cache_seqlens``), rows of at most ``index_topk``
        live tokens skipped, ``rows_per_group(mode)`` rows per group. One small graph-safe launch."""
        return self._write_schedule(self.buffers(bs, mode).seqlens_expanded, as_mode(mode), self.schedule(bs, mode))

    def replay(self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, mode: Mode | str,
               extend_seq_lens: torch.Tensor | None = None, *, refresh_schedule: bool = True,
               check_values: bool = False) -> MetadataBuffers:
        """Write the metadata of a ``bs``-bucket batch into the static buffers of ``(bs, mode)``.

        ``req_pool_indices``, ``seq_lens``: int32/int64 ``[bs]`` (padded rows: ``seq_lens = 1``,
        any valid pool index). ``seq_lens`` is the committed length (decode, verify) or the
        committed length + N (draft extend). ``extend_seq_lens``: int32/int64 ``[bs]`` for the
        variable draft-extend form; the static buffers hold ``bs * N`` rows, so it must sum to
        ``bs * N`` (other totals go through :meth:`eager`). Writes the buffers of ``(bs, mode)``
        (live prefix of the page tables, every 1-D output) and, with ``refresh_schedule``, its
        indexer schedule. No host sync and no allocation unless ``check_values`` (the kernels'
        precondition checks, which read device data; not graph-safe; see :meth:`write_metadata`).
        """
        mode = as_mode(mode)
        out = self.buffers(bs, mode)
        check_index_tensor("req_pool_indices", req_pool_indices, bs, self.device)
        check_index_tensor("seq_lens", seq_lens, bs, self.device)
        if extend_seq_lens is not None:
            check_index_tensor("extend_seq_lens", extend_seq_lens, bs, self.device)
        self.write_metadata(mode, req_pool_indices, seq_lens, out, extend_seq_lens, check_values=check_values)
        if refresh_schedule:
            self.refresh_schedule(bs, mode)
        return out

    def eager(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, mode: Mode | str,
              extend_seq_lens: torch.Tensor | None = None) -> tuple[MetadataBuffers, torch.Tensor]:
        """Metadata and indexer schedule of any batch, in fresh buffers (no graph; reads lengths on
        the host).

        The page tables are only ``max(live)`` wide (``live = s`` or ``s + N`` for verify), not W:
        every column a consumer reads, nothing more. ``req_pool_indices``, ``seq_lens``,
        ``extend_seq_lens``: int32/int64 ``[B]``, any ``B >= 1``. Returns the new buffers (rows
        ``sum(extend_seq_lens)`` in the variable draft-extend form) and a new int32
        ``[programs(mode) + 1, 2]`` schedule.
        """
        mode = as_mode(mode)
        batch = seq_lens.shape[0] if isinstance(seq_lens, torch.Tensor) and seq_lens.dim() == 1 else 0
        if batch < 1:
            raise ValueError("seq_lens must be a non-empty int32/int64 tensor [B]")
        check_index_tensor("req_pool_indices", req_pool_indices, batch, self.device)
        check_index_tensor("seq_lens", seq_lens, batch, self.device)
        rows = None
        if extend_seq_lens is not None:
            check_index_tensor("extend_seq_lens", extend_seq_lens, batch, self.device)
            rows = int(extend_seq_lens.sum())
        extra = self.num_draft_tokens if mode is Mode.TARGET_VERIFY else 0
        live_max = int(seq_lens.max()) + extra
        if live_max > self.width:
            raise ValueError(f"longest live row {live_max} exceeds the page-table width W={self.width}")
        width = max(1, live_max)
        out = MetadataBuffers.allocate(mode, batch, width, self.page_size, self.device,
                                       num_draft_tokens=self.num_draft_tokens, rows=rows)
        self.write_metadata(mode, req_pool_indices, seq_lens, out, extend_seq_lens, check_values=True,
                            req_to_token=self.req_to_token[:, :width])
        schedule = torch.zeros(self.programs(mode) + 1, 2, dtype=torch.int32, device=self.device)
        self._write_schedule(out.seqlens_expanded, mode, schedule)
        return out, schedule
