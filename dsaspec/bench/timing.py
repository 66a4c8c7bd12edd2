"""Kernel timing inside CUDA graphs, without host launch latency (docs/benchmarking.md).

Method: a graph is captured with ``[L2 flush (optional), fn]``; it is replayed ``iters`` times under
``torch.profiler`` and each replay's time is read from CUPTI as the span from the start of the first
device activity of ``fn`` (kernel, memcpy or memset) to the end of its last one, the flush kernel
excluded. A second measurement, the graph difference (``iters`` copies of ``[flush, fn]`` minus
``iters`` copies of ``[flush]``, timed with events), is reported as a cross-check.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from typing import Callable

import torch

FLUSH_BYTES = 2 * 60 * 1024 * 1024  # twice the H200's 60 MB L2

COLD_L2_METHOD = ("CUDA-graph replays with an L2 flush (2x L2) before each timed function; per-replay device "
                  "time from CUPTI (torch.profiler, first to last device activity), median of {iters}; "
                  "spread = (max-min)/median; graph-difference time as cross-check; floor = max(bytes / "
                  "measured copy bandwidth, empty kernel node); same-bytes copy = one device-to-device memcpy "
                  "moving the same bytes, timed the same way; bit-identity checked on the contract region "
                  "after timing.")


@dataclass
class Timing:
    """Per-replay device times of one function, in µs."""

    samples_us: list[float]
    graph_diff_us: float | None = None

    @property
    def median_us(self) -> float:
        return statistics.median(self.samples_us)

    @property
    def spread(self) -> float:
        """(max - min) / median over the timed replays."""
        return (max(self.samples_us) - min(self.samples_us)) / self.median_us

    def summary(self) -> dict:
        s = sorted(self.samples_us)
        return {
            "median_us": self.median_us,
            "min_us": s[0],
            "p10_us": s[len(s) // 10],
            "p90_us": s[(len(s) * 9) // 10],
            "max_us": s[-1],
            "spread": self.spread,
            "n": len(s),
            "graph_diff_us": self.graph_diff_us,
        }


class L2Flusher:
    """Writes a buffer twice the L2 size so the next kernel starts with a cold L2."""

    def __init__(self, device: torch.device | str = "cuda", nbytes: int = FLUSH_BYTES):
        self.buf = torch.empty(nbytes // 4, dtype=torch.int32, device=device)

    def __call__(self) -> None:
        self.buf.fill_(0x5A5A5A5A)


def warm_up_gpu(ms: float = 400.0) -> None:
    """Run large matmuls for about ``ms`` milliseconds so clocks leave their idle state."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(8):
            a @ a
        stop.record()
        stop.synchronize()
        if start.elapsed_time(stop) >= ms:
            return


def _capture(body: Callable[[], None], copies: int, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(copies):
            body()
    return graph


def device_events(prof) -> list[tuple[str, int, int]]:
    """(name, start_ns, end_ns) of every device activity CUPTI recorded, sorted by start."""
    out = []
    for ev in prof.profiler.kineto_results.events():
        if ev.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        start = ev.start_ns()
        out.append((ev.name(), start, start + ev.duration_ns()))
    out.sort(key=lambda e: e[1])
    return out


def replay_events(fn: Callable[[], None], *, iters: int, warmup: int = 5,
                  cold_l2: bool = True) -> list[list[tuple[str, int, int]]]:
    """The CUPTI device activities ``(name, start_ns, end_ns)`` of ``fn`` in each of ``iters``
    replays of a CUDA graph holding ``[L2 flush (with cold_l2), fn]``, the flush excluded.

    ``fn`` must be capturable (no host syncs, no allocation that changes per call). It is run
    ``warmup`` times eagerly first so Triton compiles outside the capture.
    """
    flusher = L2Flusher() if cold_l2 else None
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())

    def body() -> None:
        if flusher is not None:
            flusher()
        fn()

    graph = _capture(body, 1, stream)
    torch.cuda.synchronize()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            graph.replay()
        torch.cuda.synchronize()
    return split_replays(device_events(prof), iters, flushed=flusher is not None)


def split_replays(events: list[tuple[str, int, int]], iters: int, *,
                  flushed: bool) -> list[list[tuple[str, int, int]]]:
    """Cut the device activities of ``iters`` graph replays (sorted by start) into one list per
    replay: at each flush (the first activity of a replay, named like the very first one), which
    is dropped, when ``flushed``; else into ``iters`` equal runs. Raises when the count does not
    come out as ``iters``."""
    if flushed:
        flush_name = events[0][0] if events else None
        replays: list[list[tuple[str, int, int]]] = []
        for event in events:
            if event[0] == flush_name:
                replays.append([])
            else:
                replays[-1].append(event)
        replays = [r for r in replays if r]
    else:
        per = len(events) // iters
        if per * iters != len(events):
            raise RuntimeError(f"{len(events)} device activities for {iters} replays: not a multiple")
        replays = [events[i * per:(i + 1) * per] for i in range(iters)]
    if len(replays) != iters:
        raise RuntimeError(f"expected {iters} timed replays, CUPTI gave {len(replays)}")
    return replays


def time_in_graph(
    fn: Callable[[], None],
    *,
    iters: int = 200,
    warmup: int = 5,
    cold_l2: bool = True,
    graph_diff: bool = True,
) -> Timing:
    """Time ``fn``'s device work per CUDA-graph replay, from CUPTI (see module docstring): the span
    from the start of its first device activity to the end of its last, per replay
    (:func:`replay_events`)."""
    replays = replay_events(fn, iters=iters, warmup=warmup, cold_l2=cold_l2)
    samples = [(max(e for _, _, e in r) - min(s for _, s, _ in r)) / 1e3 for r in replays]
    diff = _graph_difference_us(fn, cold_l2) if graph_diff else None
    return Timing(samples, diff)


def _graph_difference_us(fn, cold_l2: bool, copies: int = 50, reps: int = 10) -> float:
    flusher = L2Flusher() if cold_l2 else None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())

    def with_fn() -> None:
        if flusher is not None:
            flusher()
        fn()

    def without_fn() -> None:
        if flusher is not None:
            flusher()
        else:
            torch.cuda._sleep(0)

    g_fn = _capture(with_fn, copies, stream)
    g_base = _capture(without_fn, copies, stream)
    torch.cuda.synchronize()

    def median_ms(graph) -> float:
        graph.replay()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    return (median_ms(g_fn) - median_ms(g_base)) * 1e3 / copies


def copy_bandwidth_gbps(nbytes: int = 2 << 30) -> float:
    """Measured device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return nbytes / (statistics.median(times) * 1e-3) / 1e9


def copy_time_us(nbytes: int, *, iters: int = 100, cold_l2: bool = True) -> float:
    """Median CUPTI time of one device-to-device copy moving ``nbytes`` (read + write) in a graph:
    what the same traffic costs as a plain memcpy, ramp-up included."""
    half = max(nbytes // 2, 4)
    src = torch.empty(half, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return time_in_graph(lambda: dst.copy_(src), iters=iters, cold_l2=cold_l2, graph_diff=False).median_us


def empty_kernel_us() -> float:
    """CUPTI duration of an empty kernel node in a graph, in µs (the floor of any launch)."""
    from dsaspec.ops.empty import empty_kernel

    dummy = torch.zeros(1, device="cuda")
    return time_in_graph(lambda: empty_kernel(dummy), iters=100, cold_l2=False, graph_diff=False).median_us


@dataclass
class Floors:
    """Machine floors measured once per run: copy bandwidth (GB/s) and an empty kernel node (µs)."""

    copy_gbps: float
    empty_us: float

    @classmethod
    def measure(cls) -> "Floors":
        return cls(copy_bandwidth_gbps(), empty_kernel_us())

    def floor_us(self, nbytes: int) -> float:
        """``max(bytes / copy bandwidth, empty kernel)``: no launch moving ``nbytes`` beats it."""
        return max(nbytes / (self.copy_gbps * 1e3), self.empty_us)


def measured_floors_or_none(prog: str) -> Floors | None:
    """For the benchmark script ``prog``: without a CUDA device print ``prog: error: needs a CUDA device``
    to stderr and return None (the script then exits 2); else warm the GPU up and return its measured
    :class:`Floors`."""
    if not torch.cuda.is_available():
        print(f"{prog}: error: needs a CUDA device", file=sys.stderr)
        return None
    warm_up_gpu()
    return Floors.measure()


def compare(baseline: Callable[[], None], new: Callable[[], None], *, nbytes: int, floors: Floors,
            iters: int = 200, cold_l2: bool = True) -> dict:
    """Time ``baseline`` and ``new`` side by side (same process, same method) and return the JSON
    row fields of docs/benchmarking.md: baseline_us, new_us, speedup, floor_us, spread, ...,
    and ``copy_us``: a plain device-to-device copy of the same byte count, timed the same way."""
    base = time_in_graph(baseline, iters=iters, cold_l2=cold_l2)
    cand = time_in_graph(new, iters=iters, cold_l2=cold_l2)
    copy = copy_time_us(nbytes, iters=iters, cold_l2=cold_l2)
    return {
        "baseline_us": base.median_us,
        "new_us": cand.median_us,
        "speedup": base.median_us / cand.median_us,
        "floor_us": floors.floor_us(nbytes),
        "bytes_floor_us": nbytes / (floors.copy_gbps * 1e3),
        "empty_kernel_us": floors.empty_us,
        "new_gbps": nbytes / (cand.median_us * 1e3),
        "new_over_floor": cand.median_us / floors.floor_us(nbytes),
        "bytes": nbytes,
        "copy_us": copy,
        "new_over_copy": cand.median_us / copy,
        "spread": {"baseline": base.spread, "new": cand.spread},
        "graph_diff_us": {"baseline": base.graph_diff_us, "new": cand.graph_diff_us},
        "detail": {"baseline": base.summary(), "new": cand.summary()},
    }
