"""CUDA graphs per batch bucket: the capture / replay machinery of every decode worker.

:class:`BucketGraphs` serves every phase of the runtime (plain decode in
:mod:`dsaspec.executor.decode_worker`; target verify, draft decode and draft extend in
:mod:`dsaspec.speculative.spec_worker`): one graph per batch bucket over a phase's static buffers,
warmed up on a side stream (Triton compiles there) and captured into one memory pool shared by every
phase; without graphs the same body runs eagerly over the same buffers. :func:`graphs_usable`
resolves whether graphs can run at all.
"""

from __future__ import annotations

from typing import Callable

import torch

from dsaspec.models.dsa_model import DSAModel


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
