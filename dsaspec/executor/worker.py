"""The decode-worker protocol the Engine drives, and what the plain and the speculative worker share.

A worker serves one model over one ``req_to_token`` table and one
:class:`~dsaspec.layers.attention.backend.DSAAttnBackend`. Per request it keeps, on the device and
indexed by the request's table row, what carries from one step to the next (:class:`RowCarry`): at
least the committed length ``L`` (positions ``0 .. L-1`` hold target KV) and the pending token (the
target's greedy choice for position ``L``, in no cache yet). The Engine sees only :class:`Worker`:

    prefill(row, prompt) -> first token     eager, chunked; writes the row's carry
    step(rows) -> StepResult                one decode step (or speculative iteration) of those rows,
                                            padded to a batch bucket (CUDA graphs) or eager above it
    release(row)                            the row no longer holds a request

Padded rows of a bucket point at the dummy table row (the last one, all sink slots); every step
writes their carry there and resets it (:meth:`RowCarry.reset_dummy`), so padding never grows a
position. :class:`BucketWorker` holds the shared parts: the buckets, the dummy row, the per-bucket
capture loop, the row checks and the target prefill. :func:`greedy_target_tokens` is the one place
a target token is picked.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from dsaspec.executor.graph_runner import graphs_usable
from dsaspec.layers.attention.backend import DSAAttnBackend
from dsaspec.layers.logits_processor import LogitsProcessor
from dsaspec.memory import KVPool
from dsaspec.models.dsa_model import DEFAULT_PREFILL_CHUNK, DSAModel
from dsaspec.ops.argmax_exchange import CarryWrite, draft_finalize, greedy_tokens
from dsaspec.ops.indexer import default_indexer_programs


def indexer_programs_for(model: DSAModel, kv: KVPool, device: torch.device, rows_per_group: int = 1) -> int:
    """Indexer schedule entries on ``device`` for ``model``'s index heads over ``kv``'s key cache
    dtype, rows of ``rows_per_group`` (the default configuration's programs an SM times the SMs:
    :func:`~dsaspec.ops.indexer.default_indexer_programs`)."""
    return default_indexer_programs(device, kv.kv_cache_dtype == "fp8_e4m3", rows_per_group,
                                    model.config.index_n_heads)


@dataclass
class StepResult:
    """One step's outcome per request (the order of ``rows``): ``accept_lens[i]`` tokens
    ``committed[i]`` (plain decoding: one; speculative: the accepted drafts, then the new bonus),
    and the device time of each phase in ms when timing was asked for (on CUDA)."""

    committed: list[list[int]]
    accept_lens: list[int]
    phase_ms: dict[str, float] | None = None


@runtime_checkable
class Worker(Protocol):
    """What the Engine needs of a decode worker (:class:`~dsaspec.executor.decode_worker.DecodeWorker`,
    :class:`~dsaspec.speculative.spec_worker.SpecWorker`)."""

    backend: DSAAttnBackend
    use_cuda_graph: bool

    def capture(self) -> "Worker": ...

    def bucket_for(self, bs: int) -> int | None: ...

    def prefill(self, row: int, prompt: Sequence[int], *, chunk_size: int = DEFAULT_PREFILL_CHUNK) -> int: ...

    def step(self, rows: Sequence[int], *, timed: bool = False) -> StepResult: ...

    def release(self, row: int) -> None: ...


def greedy_target_tokens(model: DSAModel, hidden: torch.Tensor, processor: LogitsProcessor | None = None, *,
                         out: torch.Tensor | None = None, carry: CarryWrite | None = None) -> torch.Tensor:
    """The target's greedy token of each row, int64 ``[rows]``: the argmax of the fp32 logits of
    ``hidden`` ``[rows, hidden_size]`` (lowest index among equal maxima, the first NaN above all).

    Without ``processor``, or in row-invariant mode, at TP 1: ``greedy_tokens`` over the LM head's
    local logits (bit for bit ``argmax(model.logits(hidden))`` without the fp32 copy; plain
    decoding's path, which row-invariant speculation reproduces). Without ``processor`` at TP > 1:
    ``argmax(model.logits(hidden))``. Otherwise ``processor.target_tokens`` over the model's head
    (the argmax exchange where it is opted in; the same tokens by its contract). ``out``: int64
    ``[rows]`` the tokens are written to. ``carry``: the rows' carry written with the tokens in the
    same launch (``draft_finalize``). No host sync (graph-safe with graph-safe ops).
    """
    if model.tp_size == 1 and (processor is None or model.row_invariant):
        out = torch.empty(hidden.shape[0], dtype=torch.int64, device=hidden.device) if out is None else out
        return greedy_tokens(model.lm_head(hidden), out, vocab_size=model.lm_head.vocab_size, carry=carry)
    tokens = torch.argmax(model.logits(hidden), dim=-1) if processor is None else processor.target_tokens(hidden)
    if carry is not None:
        return draft_finalize(tokens=tokens if out is None else out, argmax_tokens=tokens, carry=carry)
    return tokens if out is None else out.copy_(tokens)


class RowCarry:
    """Per-request carry on the device, one entry per ``req_to_token`` row (the dummy row, the
    last, included): the committed length ``seq_lens`` and the pending token ``bonus`` (int64
    ``[table_rows]``; subclasses add the fields of :attr:`FIELDS` beyond these), and on the host
    which rows hold a prefilled request (``prefilled``). The dummy row's length is ``pad_len``.
    """

    FIELDS: tuple[str, ...] = ("seq_lens", "bonus")

    def __init__(self, table_rows: int, pad_len: int, device):
        self.dummy_row = table_rows - 1
        self.pad_len = pad_len
        self.seq_lens = torch.full((table_rows,), pad_len, dtype=torch.int64, device=device)
        self.bonus = torch.zeros(table_rows, dtype=torch.int64, device=device)
        self.prefilled = [False] * table_rows

    def reset_dummy(self) -> None:
        """The dummy row's carry back to length ``pad_len`` and token 0 (no host sync): called after
        every step's write-back, so padded rows never advance."""
        dummy = slice(self.dummy_row, self.dummy_row + 1)
        self.seq_lens[dummy].fill_(self.pad_len)
        self.bonus[dummy].zero_()

    def snapshot(self, rows: Sequence[int]) -> dict:
        """Copies of the carry of table rows ``rows`` (and their prefilled flags)."""
        index = torch.tensor(list(rows), dtype=torch.int64, device=self.seq_lens.device)
        snap = {name: getattr(self, name)[index].clone() for name in self.FIELDS}
        snap["prefilled"] = [self.prefilled[r] for r in rows]
        return snap

    def restore(self, rows: Sequence[int], snapshot: dict) -> None:
        """Write a :meth:`snapshot` (of any worker's carry of the same kind over the same table)
        back to ``rows``."""
        index = torch.tensor(list(rows), dtype=torch.int64, device=self.seq_lens.device)
        for name in self.FIELDS:
            getattr(self, name)[index] = snapshot[name]
        for row, flag in zip(rows, snapshot["prefilled"]):
            self.prefilled[row] = flag


class BucketWorker:
    """The parts both decode workers share: the backend's batch buckets, the dummy row, the carry
    ``state``, the per-bucket capture loop (:meth:`_capture_bucket`, largest bucket first), the
    checks of ``rows`` and the target's prefill.

    Parameters
    ----------
    model : the target DSAModel.
    target_kv : its KVPool.
    backend : DSAAttnBackend over the request table; its ``bucket_sizes`` are the captured buckets.
    state : the workers' RowCarry over every table row.
    use_cuda_graph : None: on CUDA with the Triton ops (see ``graphs_usable``).
    processor : LogitsProcessor the target tokens go through (see :func:`greedy_target_tokens`),
        or None.
    """

    def __init__(self, model: DSAModel, target_kv: KVPool, backend: DSAAttnBackend, state: RowCarry, *,
                 use_cuda_graph: bool | None, processor: LogitsProcessor | None = None):
        self.model, self.config = model, model.config
        self.target_kv, self.backend, self.state = target_kv, backend, state
        self.processor = processor
        self.device = backend.device
        self.use_cuda_graph = graphs_usable(self.device, model, use_cuda_graph)
        self.buckets = backend.bucket_sizes
        self._captured = False

    @property
    def dummy_row(self) -> int:
        """The ``req_to_token`` row padded rows point to (the table's last row)."""
        return self.backend.req_to_token.shape[0] - 1

    def bucket_for(self, bs: int) -> int | None:
        """The bucket a batch of ``bs`` requests is padded to; None above the largest (eager)."""
        if bs < 1:
            raise ValueError(f"a step needs at least one request, got bs={bs}")
        return self.backend.bucket_for(bs)

    @torch.no_grad()
    def capture(self):
        """Every bucket's static inputs and, with graphs, its warmed-up and captured graphs, largest
        bucket first (one memory pool). Idempotent; returns the worker."""
        if self._captured:
            return self
        for bucket in reversed(self.buckets):
            self._capture_bucket(bucket)
        if self.use_cuda_graph:
            torch.cuda.synchronize()
        self._captured = True
        return self

    def _capture_bucket(self, bucket: int) -> None:
        raise NotImplementedError

    def _check_row(self, row) -> int:
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.dummy_row:
            raise ValueError(f"row must be a request row of the table, an int in [0, {self.dummy_row}), "
                             f"got {row!r}")
        return row

    def check_rows(self, rows: Sequence[int]) -> list[int]:
        """``rows`` as a list after checking them (host only): captured, at least one, every one a
        request row of the table (not the dummy row), no duplicates, each prefilled and not
        released. Raises ``ValueError`` naming ``rows``; ``RuntimeError`` before :meth:`capture`."""
        if not self._captured:
            raise RuntimeError(f"{type(self).__name__}.step before capture()")
        rows = list(rows)
        if not rows:
            raise ValueError("rows is empty: a step needs at least one request row")
        bad = [r for r in rows if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.dummy_row]
        if bad:
            raise ValueError(f"rows {bad[:4]} are not request rows of the table: expected ints in "
                             f"[0, {self.dummy_row})")
        repeated = sorted(r for r, count in Counter(rows).items() if count > 1)
        if repeated:
            raise ValueError(f"rows {repeated[:4]} appear more than once: a step takes each request row once")
        fresh = [r for r in rows if not self.state.prefilled[r]]
        if fresh:
            raise ValueError(f"rows {fresh[:4]} hold no prefilled request: prefill(row, prompt) first")
        return rows

    def release(self, row: int) -> None:
        """Mark ``row`` as holding no request (a later step of it is refused until its next prefill)."""
        self.state.prefilled[self._check_row(row)] = False

    def _padded_rows(self, rows: Sequence[int], n: int, *extra: int) -> torch.Tensor:
        """Host int64 ``[n + len(extra)]``: ``rows``, the dummy row up to ``n`` entries, ``extra``."""
        return torch.tensor(list(rows) + [self.dummy_row] * (n - len(rows)) + list(extra), dtype=torch.int64)

    def _prefill_target(self, row: int, prompt: Sequence[int], chunk_size: int):
        """The target's eager prefill of one admitted request (slots allocated): writes its KV and
        the carry ``seq_lens = len(prompt)``, ``bonus`` = its greedy last token (the caller marks the
        row prefilled once its whole carry is written). Returns ``(ids int64 [T], hidden
        [T, hidden_size], bonus int64 [1])``."""
        row = self._check_row(row)
        if len(prompt) < 1:
            raise ValueError("prompt is empty: a prefill needs at least one token")
        ids = torch.tensor(list(prompt), dtype=torch.int64, device=self.device)
        hidden = self.model.prefill(ids, self.backend.req_to_token, row, self.target_kv, chunk_size=chunk_size)
        bonus = greedy_target_tokens(self.model, hidden[-1:], self.processor)
        self.state.seq_lens[row] = len(prompt)
        self.state.bonus[row] = bonus[0]
        return ids, hidden, bonus
