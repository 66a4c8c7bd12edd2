"""The server's per-iteration host overhead, on CPU: how long an iteration of C rows takes when C
streaming clients are served over loopback, against the same engine stepped without HTTP.

The step is a stand-in for a GPU step as the host sees it (:class:`DeviceStandIn`): ``--launches``
launches, each ``--host-ms / launches`` of Python holding the GIL and then a torch call, which
releases and retakes the GIL as every torch call does (``copy_``, a graph replay), each queueing
``--step-ms / launches`` of device work on a device that runs while the host goes on; then the
sync, a wait with the GIL released until the device is done (``.cpu()`` of the outputs); then
``--row-us`` of Python per row (the outputs' ``tolist`` and slicing); ``--accept`` tokens per row.
A GIL that another thread of the process holds when the host wants it back, at any of those
points, delays the launches and so the device: what a server's event loop does in the engine's
process lands in the iteration. ``--real`` steps the tiny model instead (speculative, simulated
acceptance; slow under the Triton interpreter, which holds the GIL). Four ways to drive the same
rows (C requests of ``--prompt`` tokens, ``--max-tokens`` each):
  core     EngineCore.step in a loop (as ``Engine.generate`` does)
  loop     the EngineLoop thread, deliveries dropped (its bookkeeping and metrics, no HTTP)
  thread   ``dsaspec serve --no-engine-process``: the Starlette app under uvicorn in this process
           with the engine loop on a thread of it
  process  ``dsaspec serve`` (``--engine-process``): the app in this process, the engine loop in a
           spawned engine process (:class:`~dsaspec.serving.engine_process.EngineProcess`)
In both server modes C streaming clients run in a child process (raw asyncio sockets, so they do
not take the server's GIL). For each, over the worker steps that run all C rows: the median step
time, the median gap from one step's end to the next step's start, and the median iteration
(start to start); with ``--repeat R`` each mode runs R times and the iteration's median over the
runs is printed with its range.

  PYTHONPATH=$PWD python scripts/serving_overhead.py --concurrency 1 8 32 --repeat 5
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing
import statistics
import sys
import threading
import time


def build_engine(args, record_path=None):
    """The tiny engine of ``args`` (``--real``: the model's speculative worker; else
    :class:`DeviceStandIn`), its worker's steps recorded (:func:`record_steps`; in
    ``record_path`` too, for an engine built in an engine process)."""
    import torch

    from dsaspec import flags

    flags.select_triton_interpreter(torch.cuda.is_available())   # before anything imports triton
    from dsaspec.configs.model_config import get_config
    from dsaspec.engine.engine import Engine
    from dsaspec.models.dsa_model import DSAModel
    from dsaspec.speculative.spec_worker import SpecConfig

    torch.set_num_threads(args.threads)
    model = DSAModel(get_config(args.preset), dtype=torch.float32).init_weights(0)
    spec = SpecConfig(num_steps=3, simulate_accept_len=args.accept) if args.real else None
    engine = Engine(model, context_len=args.prompt + args.max_tokens + 8, max_batch=max(args.concurrency),
                    progress=False, speculative=spec)
    if not args.real:
        engine.worker = DeviceStandIn(args.host_ms / 1e3, args.step_ms / 1e3, round(args.accept),
                                      launches=args.launches, row=args.row_us / 1e6)
    record_steps(engine.worker, record_path)
    return engine


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class DeviceStandIn:
    """A worker whose step is a GPU step as the host sees it (the module docstring): ``launches``
    times ``host / launches`` seconds of Python holding the GIL then a torch call (releasing it),
    each queueing ``device / launches`` seconds on a device that runs from the launch on; the
    sync (a sleep, GIL released) until the device is done; ``row`` seconds of Python per row;
    ``tokens`` committed tokens per row. Prefill gives one token at once."""

    use_cuda_graph = False

    def __init__(self, host: float, device: float, tokens: int, *, launches: int, row: float):
        import torch

        self.host, self.device, self.tokens, self.launches, self.row = host, device, tokens, launches, row
        self._src, self._dst = torch.zeros(256), torch.zeros(256)

    def prefill(self, row, prompt, *, chunk_size=512) -> int:
        return prompt[-1]

    def release(self, row) -> None:
        pass

    def step(self, rows, *, timed=False):
        from dsaspec.executor.worker import StepResult

        device_free = 0.0
        for _ in range(self.launches):
            _busy(self.host / self.launches)
            self._dst.copy_(self._src)               # a torch call: drops and retakes the GIL
            device_free = max(device_free, time.perf_counter()) + self.device / self.launches
        wait = device_free - time.perf_counter()
        if wait > 0:
            time.sleep(wait)                         # the sync
        committed = []
        for row in rows:
            _busy(self.row)
            committed.append([row + 1] * self.tokens)
        return StepResult(committed, [self.tokens] * len(rows))


def record_steps(worker, path=None):
    """Wrap ``worker.step`` to record (start, end, batch) of every step into ``worker.steps``;
    with ``path``, ``worker.release`` also writes them there (JSON), for the parent of an engine
    process to read once the requests have ended."""
    steps, step, release = [], worker.step, worker.release
    worker.steps = steps

    def timed(rows, **kwargs):
        began = time.perf_counter()
        out = step(rows, **kwargs)
        steps.append((began, time.perf_counter(), len(rows)))
        return out

    def released(row):
        release(row)
        with open(path, "w") as f:
            json.dump(steps, f)

    worker.step = timed
    if path is not None:
        worker.release = released


def summary(steps, batch: int) -> dict:
    """Median step, gap and iteration (ms) over consecutive steps that both ran ``batch`` rows."""
    pairs = [(a, b) for a, b in zip(steps, steps[1:]) if a[2] == batch and b[2] == batch]
    if not pairs:
        return {"steps": 0}
    step = statistics.median((a[1] - a[0]) * 1e3 for a, _ in pairs)
    gap = statistics.median((b[0] - a[1]) * 1e3 for a, b in pairs)
    iteration = statistics.median((b[0] - a[0]) * 1e3 for a, b in pairs)
    return {"steps": len(pairs), "step_ms": step, "gap_ms": gap, "iteration_ms": iteration}


def prompts(args, c):
    return [[(7 * i + j) % 1000 + 1 for j in range(args.prompt)] for i in range(c)]


def run_core(engine, args, c):
    from dsaspec.engine.engine import EngineCore

    core = EngineCore(engine)
    engine.worker.steps.clear()
    for p in prompts(args, c):
        core.add_request(p, args.max_tokens)
    while core.has_work:
        core.step()
    return summary(engine.worker.steps, c)


def run_loop(engine, args, c):
    from dsaspec.serving.engine_loop import EngineLoop
    from dsaspec.serving.metrics import ServerMetrics

    loop = EngineLoop(engine, max_waiting=c, metrics=ServerMetrics())
    engine.worker.steps.clear()
    done = threading.Semaphore(0)
    for p in prompts(args, c):
        loop.submit(p, args.max_tokens, lambda d: d.finish_reason is not None and done.release())
    loop.start()
    for _ in range(c):
        done.acquire()
    loop.stop()
    return summary(engine.worker.steps, c)


async def _stream(port, prompt, max_tokens):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    seen = b""
    while b"data: [DONE]" not in seen[-64:]:
        got = await reader.read(65536)
        if not got:
            raise RuntimeError(f"the server closed the stream: {seen[:200]!r}")
        seen += got
    writer.close()


def _clients(port, all_prompts, max_tokens):
    async def main():
        await asyncio.gather(*(_stream(port, p, max_tokens) for p in all_prompts))
    asyncio.run(main())


def run_thread(engine, args, c):
    from dsaspec.serving.engine_loop import EngineLoop
    from dsaspec.serving.metrics import ServerMetrics

    engine.worker.steps.clear()
    serve(EngineLoop(engine, max_waiting=c, metrics=ServerMetrics()), args, c)
    return summary(engine.worker.steps, c)


def run_process(engine, args, c):
    import os
    import tempfile

    from dsaspec.serving.engine_process import EngineProcess

    fd, path = tempfile.mkstemp(suffix=".json", prefix="serving_overhead_")
    os.close(fd)
    try:
        serve(EngineProcess(functools.partial(build_engine, args, path), max_waiting=c), args, c)
        with open(path) as f:
            steps = [tuple(s) for s in json.load(f)]
    finally:
        os.unlink(path)
    return summary(steps, c)


def serve(loop, args, c) -> None:
    """Serve ``loop`` (an EngineLoop or an EngineProcess) under uvicorn on a thread of this process
    while C streaming clients in a child process run their requests."""
    import uvicorn

    from dsaspec.serving.api import Server, build_app

    server = Server(loop, model_name=args.preset, text=None, info={})
    runner = uvicorn.Server(uvicorn.Config(build_app(server), host="127.0.0.1", port=0, log_level="warning",
                                           access_log=False))
    thread = threading.Thread(target=runner.run, daemon=True)  # the CLI runs it on the main thread
    thread.start()
    while not runner.started:
        time.sleep(0.01)
    port = runner.servers[0].sockets[0].getsockname()[1]
    child = multiprocessing.get_context("spawn").Process(target=_clients, args=(port, prompts(args, c),
                                                                                args.max_tokens))
    child.start()
    child.join()
    runner.should_exit = True
    thread.join()
    if child.exitcode:
        raise SystemExit(f"the clients failed (exit {child.exitcode})")


MODES = {"core": run_core, "loop": run_loop, "thread": run_thread, "process": run_process}


def _float_at_least(low: float, strict: bool):
    """argparse type: a number >= ``low`` (> ``low`` when ``strict``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (value > low if strict else value >= low):
            raise argparse.ArgumentTypeError(f"expected a number {'>' if strict else '>='} {low:g}, got {text!r}")
        return value
    return parse


def main(argv=None) -> int:
    from dsaspec.cli_parsing import Parser, parse_or_exit, positive_int
    from dsaspec.commands.serve import nonnegative_float

    p = Parser(prog="serving_overhead.py", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt", type=positive_int, default=32)
    p.add_argument("--max-tokens", type=positive_int, default=256)
    p.add_argument("--accept", type=_float_at_least(1, strict=False), default=3.0, help="tokens per row per step (simulated accept length)")
    p.add_argument("--host-ms", type=nonnegative_float, default=0.6,
                   help="the stand-in step's Python before the sync (ms, GIL held), split over its launches")
    p.add_argument("--launches", type=positive_int, default=6,
                   help="the stand-in step's launches (torch calls, each releasing the GIL) before the sync")
    p.add_argument("--step-ms", type=nonnegative_float, default=9.0,
                   help="the stand-in step's device time (ms), queued by the launches, waited with the GIL released")
    p.add_argument("--row-us", type=nonnegative_float, default=5.0,
                   help="the stand-in step's Python per row after the sync (µs)")
    p.add_argument("--real", action="store_true",
                   help="step the model (speculative, simulated acceptance) instead of the stand-in (slow: the "
                        "Triton interpreter)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads")
    p.add_argument("--switch-interval", type=_float_at_least(0, strict=True), default=None,
                   help="sys.setswitchinterval seconds for this process (default: Python's)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--repeat", type=positive_int, default=1, help="runs of each mode (interleaved)")
    args = parse_or_exit(p, argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    engine = build_engine(args)
    run_core(engine, argparse.Namespace(**{**vars(args), "max_tokens": 8}), 1)    # warm-up
    print(f"{'mode':7} {'C':>3} {'steps':>5} {'step ms':>8} {'gap ms':>7} {'iter ms':>8} {'range':>15} {'vs first':>8}")
    for c in args.concurrency:
        runs = {mode: [] for mode in args.modes}
        for _ in range(args.repeat):                 # interleaved, so drifts of the machine hit every mode
            for mode in args.modes:
                runs[mode].append(MODES[mode](engine, args, c))
        base = None
        for mode in args.modes:
            done = [r for r in runs[mode] if r["steps"]]
            if not done:
                print(f"{mode:7} {c:3d} no steps ran all {c} rows")
                continue
            it = [r["iteration_ms"] for r in done]
            median = {k: statistics.median(r[k] for r in done) for k in ("steps", "step_ms", "gap_ms")}
            base = base or statistics.median(it)
            print(f"{mode:7} {c:3d} {median['steps']:5.0f} {median['step_ms']:8.3f} {median['gap_ms']:7.3f} "
                  f"{statistics.median(it):8.3f} {min(it):7.3f}-{max(it):7.3f} "
                  f"{(statistics.median(it) / base - 1) * 100:+7.1f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
