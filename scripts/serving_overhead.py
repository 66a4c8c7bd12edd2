"""The server's per-iteration host overhead, on CPU: how long the engine thread spends between two
decode steps (not in ``EngineCore.decode``) when C streaming clients are served over loopback,
against the same engine stepped without HTTP.

The step is a stand-in for a GPU step as the host sees it (``--host-ms`` of Python holding the
GIL, then ``--step-ms`` of waiting with it released, ``--accept`` tokens per row), so what is
measured is the host's own work around it; ``--real`` steps the tiny model instead (speculative,
simulated acceptance; slow under the Triton interpreter, which holds the GIL). Three ways to
drive the same rows (C requests of ``--prompt`` tokens, ``--max-tokens`` each):
  core    EngineCore.step in a loop (as ``Engine.generate`` does)
  loop    the EngineLoop thread, deliveries dropped (its bookkeeping and metrics, no HTTP)
  server  the Starlette app under uvicorn in this process, C streaming clients in a child
          process (raw asyncio sockets, so the clients do not take this process's GIL)
For each, over the decode steps that run all C rows: the median step (decode) time, the median
gap from one step's end to the next step's start, and their sum, the iteration.

  PYTHONPATH=$PWD python scripts/serving_overhead.py --concurrency 1 8 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import threading
import time


def build_engine(args):
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
        engine.worker = DeviceStandIn(args.host_ms / 1e3, args.step_ms / 1e3, round(args.accept))
    return engine


class DeviceStandIn:
    """A worker whose step is a GPU step as the host sees it: ``host`` seconds of Python holding
    the GIL (building inputs, launching), then ``device`` seconds of waiting with the GIL released
    (the sync), then ``tokens`` committed tokens per row; prefill gives one token."""

    def __init__(self, host: float, device: float, tokens: int):
        self.host, self.device, self.tokens = host, device, tokens

    def prefill(self, row, prompt, *, chunk_size=512) -> int:
        return prompt[-1]

    def release(self, row) -> None:
        pass

    def step(self, rows, *, timed=False):
        from dsaspec.executor.worker import StepResult

        end = time.perf_counter() + self.host
        while time.perf_counter() < end:
            pass
        time.sleep(self.device)
        return StepResult([[row + 1] * self.tokens for row in rows], [self.tokens] * len(rows))


def record_steps(core):
    """Wrap ``core.decode`` to record (start, end, batch) of every step; returns the list."""
    steps, decode = [], core.decode

    def timed(out=None):
        began = time.perf_counter()
        out = decode(out)
        steps.append((began, time.perf_counter(), out.batch))
        return out

    core.decode = timed
    return steps


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
    steps = record_steps(core)
    for p in prompts(args, c):
        core.add_request(p, args.max_tokens)
    while core.has_work:
        core.step()
    return summary(steps, c)


def run_loop(engine, args, c):
    from dsaspec.serving.engine_loop import EngineLoop
    from dsaspec.serving.metrics import ServerMetrics

    loop = EngineLoop(engine, max_waiting=c, metrics=ServerMetrics())
    steps = record_steps(loop.core)
    done = threading.Semaphore(0)
    for p in prompts(args, c):
        loop.submit(p, args.max_tokens, lambda d: d.finish_reason is not None and done.release())
    loop.start()
    for _ in range(c):
        done.acquire()
    loop.stop()
    return summary(steps, c)


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


def run_server(engine, args, c):
    import uvicorn

    from dsaspec.serving.api import Server, build_app
    from dsaspec.serving.engine_loop import EngineLoop
    from dsaspec.serving.metrics import ServerMetrics

    loop = EngineLoop(engine, max_waiting=c, metrics=ServerMetrics())
    steps = record_steps(loop.core)
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
    return summary(steps, c)


MODES = {"core": run_core, "loop": run_loop, "server": run_server}


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
    p.add_argument("--host-ms", type=nonnegative_float, default=2.0,
                   help="the stand-in step's host time (ms), Python holding the GIL")
    p.add_argument("--step-ms", type=nonnegative_float, default=8.0,
                   help="the stand-in step's device time (ms) after it, waited with the GIL released")
    p.add_argument("--real", action="store_true",
                   help="step the model (speculative, simulated acceptance) instead of the stand-in (slow: the "
                        "Triton interpreter)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads")
    p.add_argument("--switch-interval", type=_float_at_least(0, strict=True), default=None,
                   help="sys.setswitchinterval seconds for this process (default: Python's)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    args = parse_or_exit(p, argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    engine = build_engine(args)
    run_core(engine, argparse.Namespace(**{**vars(args), "max_tokens": 8}), 1)    # warm-up
    print(f"{'mode':6} {'C':>3} {'steps':>5} {'step ms':>8} {'gap ms':>7} {'iter ms':>8} {'vs core':>8}")
    for c in args.concurrency:
        base = None
        for mode in args.modes:
            r = MODES[mode](engine, args, c)
            if not r["steps"]:
                print(f"{mode:6} {c:3d} no steps ran all {c} rows")
                continue
            base = base or r["iteration_ms"]
            print(f"{mode:6} {c:3d} {r['steps']:5d} {r['step_ms']:8.3f} {r['gap_ms']:7.3f} {r['iteration_ms']:8.3f} "
                  f"{(r['iteration_ms'] / base - 1) * 100:+7.1f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
