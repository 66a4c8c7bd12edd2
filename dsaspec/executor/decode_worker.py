"""Plain greedy decoding as a :class:`~dsaspec.executor.worker.Worker`: one decode step per batch
bucket from a CUDA graph.

One :class:`DecodeWorker` serves one model, one target KV pool and one
:class:`~dsaspec.layers.attention.backend.DSAAttnBackend`. Per request row it carries, on the
device (:class:`~dsaspec.executor.worker.RowCarry`), the committed length ``L`` (the position of the
pending token) and the pending token itself. A step of ``bs`` rows pads the batch to the smallest
bucket holding it:

    load(rows)        host -> static rows, padded with the dummy row (one copy)
    prepare           positions = L[rows], input ids = pending[rows], seq_lens = positions + 1,
                      out_cache_loc = req_to_token[rows, positions] (one kernel with the Triton ops:
                      ops/decode_inputs.py), backend.replay (metadata + indexer schedule)
                                                                                   (eager, no sync)
    graph replay      the captured forward -> LM head -> greedy token into ``next_tokens``, with
                      L[rows] += 1, pending[rows] = next token and the dummy row's carry reset in
                      the same launch (``greedy_target_tokens`` with a ``CarryWrite``)

then one device-to-host copy of the tokens. Padded rows read the dummy table row (all
``SINK_SLOT``) at position 0 with length 1 and write their cache entry to ``SINK_SLOT``, so they never
touch a live request. Without CUDA (or with graphs off) the same buffers run the forward eagerly.
Batches above the largest bucket take the backend's eager metadata and an eager forward.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dsaspec.configs.runtime_options import RuntimeOptions
from dsaspec.executor.graph_runner import BucketGraphs
from dsaspec.executor.worker import (BucketWorker, RowCarry, StepResult, greedy_target_tokens,
                                     indexer_programs_for)
from dsaspec.layers.attention.backend import DSAAttnBackend
from dsaspec.layers.attention.inputs import AttentionInputs
from dsaspec.memory import PAGE_SIZE, KVPool, ReqToTokenPool
from dsaspec.ops.argmax_exchange import CarryWrite
from dsaspec.ops.decode_inputs import decode_inputs
from dsaspec.models.dsa_model import DEFAULT_PREFILL_CHUNK, DSAModel
from dsaspec.forward_mode import Mode


class _DecodeBatch:
    """The int64 ``[n]`` tensors one decode step works on, rows of one ``[6, n]`` buffer (static
    views of a bucket, or fresh for an eager batch): the table ``rows``, their ``positions`` and
    ``input_ids`` gathered from the carry, ``seq_lens = positions + 1``, the KV slots written
    (``out_cache_loc``) and the greedy ``next_tokens``."""

    NAMES = ("rows", "positions", "input_ids", "seq_lens", "out_cache_loc", "next_tokens")

    def __init__(self, data: torch.Tensor):
        self.data = data
        self.n = data.shape[1]
        for name, tensor in zip(self.NAMES, data):
            setattr(self, name, tensor)

    @classmethod
    def allocate(cls, n: int, device) -> "_DecodeBatch":
        return cls(torch.zeros(len(cls.NAMES), n, dtype=torch.int64, device=device))

    def view(self, n: int) -> "_DecodeBatch":
        return _DecodeBatch(self.data[:, :n])


class DecodeWorker(BucketWorker):
    """Plain greedy decoding of one model over one backend's batch buckets.

    Parameters
    ----------
    model : DSAModel
        The target model (its ops must be graph-safe, i.e. ``use_triton``, when graphs are used).
    kv : KVPool
        The target KV pool (``num_hidden_layers`` layers, model dtype).
    backend : DSAAttnBackend
        Owner of the decode metadata buffers; its ``bucket_sizes`` are the captured buckets.
    use_cuda_graph : bool or None
        Capture and replay CUDA graphs (default: when the table is on CUDA and the model runs the
        Triton ops). Without graphs every step runs the forward eagerly over the same buffers.

    Attributes
    ----------
    state : RowCarry
        Per table row: ``seq_lens`` = committed length ``L`` (the pending token's position; the
        dummy row 0) and ``bonus`` = the pending token.
    next_tokens : Tensor
        int64 ``[max_bucket]``: the greedy token of each row after :meth:`run`.
    """

    def __init__(self, model: DSAModel, kv: KVPool, backend: DSAAttnBackend, *,
                 use_cuda_graph: bool | None = None):
        state = RowCarry(backend.req_to_token.shape[0], 0, backend.device)
        super().__init__(model, kv, backend, state, use_cuda_graph=use_cuda_graph)
        self.graphs = BucketGraphs(self.use_cuda_graph)
        self.max_bucket = self.buckets[-1]
        self._static = _DecodeBatch.allocate(self.max_bucket, self.device)
        self._attn: dict[int, AttentionInputs] = {}

    @property
    def next_tokens(self) -> torch.Tensor:
        return self._static.next_tokens

    def _capture_bucket(self, bucket: int) -> None:
        self.backend.capture(bucket, Mode.DECODE)
        attn = self._attn[bucket] = self.backend.attention_inputs(
            bucket, Mode.DECODE, workspace=self.model.attention_workspace(
                bucket, fp8_cache=self.target_kv.kv_cache_dtype == "fp8_e4m3"))
        batch = self._static.view(bucket)
        self.load([], bucket)                   # every row padding: valid metadata to capture over
        self.prepare(bucket)
        self.graphs.capture(bucket, lambda: self._forward(batch, attn, check_values=False))

    # ---- prefill ---------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, row: int, prompt: Sequence[int], *, chunk_size: int = DEFAULT_PREFILL_CHUNK) -> int:
        """Eager prefill of one admitted request (slots allocated): the target over the prompt
        in chunks of ``chunk_size`` rows. Returns the first generated token (the row's pending
        token, at position ``len(prompt)``)."""
        bonus = self._prefill_target(row, prompt, chunk_size)[2]
        self.state.prefilled[row] = True
        return int(bonus)

    # ---- one step --------------------------------------------------------------------------
    def load(self, rows: Sequence[int], bucket: int) -> None:
        """Write ``rows`` (table rows, not checked: :meth:`step` checks them) into the static rows,
        padded to ``bucket`` with the dummy row. One host -> device copy."""
        if len(rows) > bucket or bucket > self.max_bucket:
            raise ValueError(f"rows: {len(rows)} do not fit bucket {bucket} (largest bucket {self.max_bucket})")
        self._static.rows[:bucket].copy_(self._padded_rows(rows, bucket))

    def _gather(self, batch: _DecodeBatch, check_values: bool = False) -> None:
        """``positions``, ``input_ids``, ``seq_lens`` and ``out_cache_loc`` of ``batch`` from its rows
        and their carry: one kernel (:func:`~dsaspec.ops.decode_inputs.decode_inputs`) with the
        model's Triton ops, else its five torch launches, the same values. The rows are checked on the
        host before (:meth:`step`); ``check_values`` checks them and their positions again against the
        table (a host sync: eager batches only)."""
        if self.model.use_triton:
            decode_inputs(batch.rows, self.state.seq_lens, self.state.bonus, self.backend.req_to_token,
                          batch.positions, batch.input_ids, batch.seq_lens, batch.out_cache_loc,
                          check_values=check_values)
            return
        torch.index_select(self.state.seq_lens, 0, batch.rows, out=batch.positions)
        torch.index_select(self.state.bonus, 0, batch.rows, out=batch.input_ids)
        torch.add(batch.positions, 1, out=batch.seq_lens)
        batch.out_cache_loc.copy_(self.backend.req_to_token[batch.rows, batch.positions])

    def prepare(self, bucket: int) -> None:
        """From the loaded rows of a ``bucket`` batch: their positions and input ids from the carry,
        ``seq_lens = positions + 1``, ``out_cache_loc = req_to_token[rows, positions]``, then the
        backend's metadata replay (its decode buffers and indexer schedule of ``bucket``). No host
        sync."""
        batch = self._static.view(bucket)
        self._gather(batch)
        self.backend.replay(bucket, batch.rows, batch.seq_lens, Mode.DECODE)

    def _forward(self, batch: _DecodeBatch, attn: AttentionInputs, check_values: bool) -> None:
        """The forward, the greedy tokens, and the carry written back (the dummy row's reset)."""
        hidden = self.model(batch.input_ids, batch.positions, batch.out_cache_loc, self.target_kv, attn,
                            check_values=check_values)
        state = self.state
        greedy_target_tokens(self.model, hidden, out=batch.next_tokens, carry=CarryWrite(
            batch.rows, batch.seq_lens, state.seq_lens, state.bonus, state.dummy_row, state.pad_len))

    @torch.no_grad()
    def run(self, bucket: int, *, use_graph: bool | None = None) -> torch.Tensor:
        """One greedy decode step of the loaded ``bucket`` batch: :meth:`prepare`, then the graph
        replay (or the eager forward with ``use_graph=False`` / without graphs). Returns the
        int64 ``[bucket]`` view of ``next_tokens`` (padded rows included). Writes the KV caches at
        ``out_cache_loc`` and the rows' carry (so consecutive runs decode on). No host sync on the
        graph path."""
        if not self._captured:
            raise RuntimeError("DecodeWorker.run before capture()")
        self.prepare(bucket)
        batch = self._static.view(bucket)
        self.graphs.run(bucket, lambda: self._forward(batch, self._attn[bucket], not self.use_cuda_graph),
                        use_graph=use_graph)
        return batch.next_tokens

    @torch.no_grad()
    def step(self, rows: Sequence[int], *, timed: bool = False) -> StepResult:
        """One greedy decode step of the requests in table rows ``rows`` (each prefilled, with a
        slot at its next position; see :meth:`check_rows`): one committed token each (host ints;
        one sync). Batches above the largest bucket run the backend's eager metadata and an eager
        forward. ``timed`` is accepted for the protocol; a plain step records no phases."""
        rows = self.check_rows(rows)
        n = len(rows)
        bucket = self.bucket_for(n)
        if bucket is None:
            batch = _DecodeBatch.allocate(n, self.device)
            batch.rows.copy_(self._padded_rows(rows, n))
            self._gather(batch, check_values=True)
            attn = self.backend.eager_attention_inputs(batch.rows, batch.seq_lens, Mode.DECODE)
            self._forward(batch, attn, check_values=True)
            tokens = batch.next_tokens
        else:
            self.load(rows, bucket)
            tokens = self.run(bucket)
        return StepResult(committed=[[t] for t in tokens[:n].tolist()], accept_lens=[1] * n)


def build_decode_worker(model: DSAModel, req_pool: ReqToTokenPool, kv: KVPool, *, bucket_sizes,
                        force_kernel: str | None = None, use_cuda_graph: bool | None = None,
                        options: RuntimeOptions | None = None) -> DecodeWorker:
    """A captured :class:`DecodeWorker` over ``req_pool``'s table with its own decode backend, whose
    metadata kernels and budget come from ``options`` (default ``model.options``) and whose indexer
    schedules have the default configuration's programs (:func:`indexer_programs_for`)."""
    options = model.options if options is None else options
    backend = DSAAttnBackend(req_pool.req_to_token, index_topk=model.config.index_topk, page_size=PAGE_SIZE,
                             bucket_sizes=bucket_sizes, force_kernel=force_kernel,
                             num_sms=indexer_programs_for(model, kv, req_pool.req_to_token.device),
                             budget=options.metadata_program_budget,
                             bounded_metadata=options.bounded_replay_metadata)
    return DecodeWorker(model, kv, backend, use_cuda_graph=use_cuda_graph).capture()
