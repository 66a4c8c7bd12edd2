"""The ``dsaspec`` command: ``dsaspec bench NAME [...]`` and ``dsaspec generate [...]``.

Each benchmark lives in ``dsaspec/bench/<module>.py`` with ``add_arguments(parser)`` and
``run(args) -> int``; it is registered in ``BENCHMARKS`` below.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name on the command line -> module under dsaspec.bench
BENCHMARKS = {
    "metadata": "metadata",
    "draft-metadata": "draft_metadata",
    "draft-step": "draft_step",
    "decode": "decode",
    "dsa-ops": "dsa_ops",
    "e2e": "e2e",
}


def _use_interpreter_without_cuda() -> None:
    # Must happen before anything imports triton.
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _available_benchmarks() -> dict:
    found = {}
    for name, module in BENCHMARKS.items():
        try:
            found[name] = importlib.import_module(f"dsaspec.bench.{module}")
        except ModuleNotFoundError as err:
            if err.name != f"dsaspec.bench.{module}":
                raise
    return found


def main(argv: list[str] | None = None) -> int:
    _use_interpreter_without_cuda()
    parser = argparse.ArgumentParser(prog="dsaspec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="run a benchmark and write benchmarks/results/<machine>/")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    modules = _available_benchmarks()
    for name, module in modules.items():
        p = bench_sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    p_all = bench_sub.add_parser("all", help="every benchmark with its defaults, one after another")
    p_all.set_defaults(run=lambda args: _run_all(modules, args))

    try:
        generate = importlib.import_module("dsaspec.runtime.generate_cli")
    except ModuleNotFoundError as err:
        if err.name != "dsaspec.runtime.generate_cli":
            raise
    else:
        p = sub.add_parser("generate", help="greedy generation with the dsaspec runtime")
        generate.add_arguments(p)
        p.set_defaults(run=generate.run)

    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


def _run_all(modules: dict, _args) -> int:
    status = 0
    for name, module in modules.items():
        print(f"== dsaspec bench {name}", flush=True)
        p = argparse.ArgumentParser(prog=f"dsaspec bench {name}")
        module.add_arguments(p)
        status |= int(module.run(p.parse_args([])) or 0)
    return status


if __name__ == "__main__":
    sys.exit(main())
