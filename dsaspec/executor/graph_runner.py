"""CUDA graphs per batch bucket, and the greedy decode step built on them.

:class:`BucketGraphs` is the capture / replay machinery every phase of the runtime uses (decode
here, target verify, draft decode and draft extend in :mod:`dsaspec.speculative.spec_worker`): one
graph per batch bucket over a phase's static buffers, warmed up on a side stream (Triton compiles
there) and captured into one memory pool shared by every phase; without graphs the same body runs
eagerly over the same buffers.

One :class:`DecodeGraphRunner` serves one model, one target KV pool and one
:class:`~dsaspec.layers.attention.backend.DSAAttnBackend`. For every batch bucket of the backend it
owns the :class:`~dsaspec.layers.attention.inputs.AttentionInputs` over the backend's static decode buffers
and, on CUDA, a graph of ``model forward -> LM head -> argmax`` captured over static buffers. A
decode step of ``bs`` requests pads the batch to the smallest bucket holding it:

    load(ids, positions, rows)      host -> static inputs (padded rows: token 0, position 0, dummy row)
    prepare(bucket)                 seq_lens = positions + 1, out_cache_loc = req_to_token[row, position],
                                    backend.replay (metadata + indexer schedule)       (eager, no sync)
    graph.replay()                  the captured forward + greedy argmax into ``next_tokens``

Padded rows read the dummy table row (all ``SINK_SLOT``) with length 1 and write their cache entry
to ``SINK_SLOT``, so they never touch a live request. Without CUDA (or with graphs off) the same
buffers run the forward eagerly. Batches above the largest bucket take the backend's eager
metadata and an eager forward.
"""

from __future__ import annotations

import torch

from typing import Callable

from dsaspec.layers.attention.backend import DSAAttnBackend
from dsaspec.ops.dsa_metadata_common import Mode
from dsaspec.memory import KVPool
from dsaspec.layers.attention.inputs import AttentionInputs
from dsaspec.models.dsa_model import DSAModel

_IDS, _POSITIONS, _ROWS = range(3)


def graphs_usable(device: torch.device, model: DSAModel, use_cuda_graph: bool | None) -> bool:
    """Resolve ``use_cuda_graph`` (None: on CUDA with the Triton ops); a clear error when graphs
    are asked for where they cannot run."""
    on_cuda = device.type == "cuda"
    if use_cuda_graph is None:
        return on_cuda and model.use_triton
    if use_cuda_graph and not on_cuda:
        raise ValueError("use_cuda_graph=True needs the req_to_token table on a CUDA device")
    if use_cuda_graph and not model.use_triton:
        raise ValueError("use_cuda_graph=True needs model.use_triton=True (the torch ops sync with "
                         "the host and cannot be captured)")
    return bool(use_cuda_graph)


class BucketGraphs:
    """One CUDA graph per batch bucket of one phase, captured over the phase's static buffers.

    Parameters
    ----------
    enabled : capture graphs (False: :meth:`run` calls the body eagerly every time).
    pool : graph memory pool handle shared with other phases (``torch.cuda.graph_pool_handle()``);
        None: the first capture makes one.
    """

    def __init__(self, enabled: bool, pool=None):
        self.enabled = enabled
        self.pool = pool
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def capture(self, bucket: int, body: Callable[[], None]) -> None:
        """Run ``body`` twice on a side stream (warm-up: Triton compiles, allocator settles), then
        capture it as the graph of ``bucket``. No-op when disabled."""
        if not self.enabled:
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            body()
        self.pool = graph.pool()
        self._graphs[bucket] = graph

    def run(self, bucket: int, body: Callable[[], None], *, use_graph: bool | None = None) -> None:
        """Replay the graph of ``bucket`` (or, disabled or ``use_graph=False``, run ``body``)."""
        if self.enabled and use_graph is not False:
            self._graphs[bucket].replay()
        else:
            body()


class DecodeGraphRunner:
    """Greedy decode steps of one model over one backend's batch buckets.

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
    input_ids, positions, req_pool_indices : Tensor
        int64 ``[max_bucket]`` static step inputs (views of one buffer).
    seq_lens, out_cache_loc : Tensor
        int64 ``[max_bucket]``: ``positions + 1`` and the rows' KV slots, written by :meth:`prepare`.
    next_tokens : Tensor
        int64 ``[max_bucket]``: the greedy token of each row after :meth:`run`.
    """

    def __init__(self, model: DSAModel, kv: KVPool, backend: DSAAttnBackend, *,
                 use_cuda_graph: bool | None = None, pool=None):
        self.model, self.kv, self.backend = model, kv, backend
        self.use_cuda_graph = graphs_usable(backend.device, model, use_cuda_graph)
        self.graphs = BucketGraphs(self.use_cuda_graph, pool)
        self.max_bucket = backend.bucket_sizes[-1]
        device = backend.device
        self._inputs = torch.zeros(3, self.max_bucket, dtype=torch.int64, device=device)
        self.input_ids = self._inputs[_IDS]
        self.positions = self._inputs[_POSITIONS]
        self.req_pool_indices = self._inputs[_ROWS]
        self.seq_lens = torch.ones(self.max_bucket, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(self.max_bucket, dtype=torch.int64, device=device)
        self.next_tokens = torch.zeros(self.max_bucket, dtype=torch.int64, device=device)
        self._attn: dict[int, AttentionInputs] = {}
        self._captured = False

    @property
    def dummy_row(self) -> int:
        """The ``req_to_token`` row padded rows point to (the table's last row)."""
        return self.backend.req_to_token.shape[0] - 1

    @torch.no_grad()
    def capture(self) -> "DecodeGraphRunner":
        """Allocate every bucket's attention inputs and, with graphs, warm up (Triton compiles) and
        capture one graph per bucket, largest first, sharing one memory pool. Idempotent."""
        if self._captured:
            return self
        topk = self.model.config.index_topk
        for bucket in reversed(self.backend.bucket_sizes):
            metadata = self.backend.capture(bucket, Mode.DECODE)
            self._attn[bucket] = AttentionInputs.from_metadata(
                metadata, self.backend.schedule(bucket, Mode.DECODE), topk,
                workspace=self.model.attention_workspace(bucket))
            self.load([], [], [], bucket)           # every row padding: valid metadata to capture over
            self.prepare(bucket)
            self.graphs.capture(bucket, lambda: self._forward(bucket, check_values=False))
        if self.use_cuda_graph:
            torch.cuda.synchronize()
        self._captured = True
        return self

    def bucket_for(self, bs: int) -> int | None:
        """The bucket a batch of ``bs`` requests is padded to; None above the largest (eager)."""
        if bs < 1:
            raise ValueError(f"a decode step needs at least one request, got bs={bs}")
        return self.backend.bucket_for(bs)

    def load(self, input_ids, positions, req_pool_indices, bucket: int) -> None:
        """Write ``bs`` requests' inputs (host sequences of ints: last token, its position = tokens
        already cached, table row) into the static inputs, padded to ``bucket`` rows (token 0,
        position 0, the dummy row). One host -> device copy."""
        bs = len(input_ids)
        if not len(positions) == len(req_pool_indices) == bs:
            raise ValueError(f"input_ids, positions and req_pool_indices must have the same length, "
                             f"got {bs}, {len(positions)}, {len(req_pool_indices)}")
        if bs > bucket or bucket > self.max_bucket:
            raise ValueError(f"bs={bs} does not fit bucket {bucket} (largest bucket {self.max_bucket})")
        pad = bucket - bs
        host = torch.tensor([list(input_ids) + [0] * pad, list(positions) + [0] * pad,
                             list(req_pool_indices) + [self.dummy_row] * pad], dtype=torch.int64)
        self._inputs[:, :bucket].copy_(host)

    def prepare(self, bucket: int) -> None:
        """From the static inputs of a ``bucket`` batch: ``seq_lens = positions + 1``,
        ``out_cache_loc = req_to_token[rows, positions]``, then the backend's metadata replay
        (writes its decode buffers and indexer schedule of ``bucket``). No host sync."""
        positions = self.positions[:bucket]
        rows = self.req_pool_indices[:bucket]
        torch.add(positions, 1, out=self.seq_lens[:bucket])
        self.out_cache_loc[:bucket].copy_(self.backend.req_to_token[rows, positions])
        self.backend.replay(bucket, rows, self.seq_lens[:bucket], Mode.DECODE)

    def _forward(self, bucket: int, *, check_values: bool) -> None:
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket], self.out_cache_loc[:bucket],
                            self.kv, self._attn[bucket], check_values=check_values)
        torch.argmax(self.model.logits(hidden), dim=-1, out=self.next_tokens[:bucket])

    @torch.no_grad()
    def run(self, bucket: int, *, use_graph: bool | None = None) -> torch.Tensor:
        """One greedy decode step of the loaded ``bucket`` batch: :meth:`prepare`, then the graph
        replay (or the eager forward with ``use_graph=False`` / without graphs). Returns the
        int64 ``[bucket]`` view of ``next_tokens`` (padded rows included). Writes the KV caches at
        ``out_cache_loc``. No host sync on the graph path."""
        if not self._captured:
            raise RuntimeError("DecodeGraphRunner.run before capture()")
        self.prepare(bucket)
        self.graphs.run(bucket, lambda: self._forward(bucket, check_values=not self.use_cuda_graph),
                        use_graph=use_graph)
        return self.next_tokens[:bucket]

    @torch.no_grad()
    def step(self, input_ids, positions, req_pool_indices, *, use_graph: bool | None = None) -> list[int]:
        """One greedy decode step of ``bs`` requests given as host sequences of ints (last token,
        its position, table row); returns the ``bs`` next tokens (host ints; syncs). Batches above
        the largest bucket run the backend's eager metadata and an eager forward."""
        bs = len(input_ids)
        bucket = self.bucket_for(bs)
        if bucket is None:
            return self._eager_step(input_ids, positions, req_pool_indices)
        self.load(input_ids, positions, req_pool_indices, bucket)
        return self.run(bucket, use_graph=use_graph)[:bs].tolist()

    def _eager_step(self, input_ids, positions, req_pool_indices) -> list[int]:
        device = self.backend.device
        ids, pos, rows = torch.tensor([list(input_ids), list(positions), list(req_pool_indices)],
                                      dtype=torch.int64).to(device)
        metadata, schedule = self.backend.eager(rows, pos + 1, Mode.DECODE)
        attn = AttentionInputs.from_metadata(metadata, schedule, self.model.config.index_topk)
        loc = self.backend.req_to_token[rows, pos].long()
        hidden = self.model(ids, pos, loc, self.kv, attn)
        return self.model.logits(hidden).argmax(-1).tolist()
