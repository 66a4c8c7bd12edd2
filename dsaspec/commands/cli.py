"""The ``dsaspec`` command: ``dsaspec bench NAME [...]``, ``dsaspec generate [...]`` and ``dsaspec serve [...]``.

Each benchmark lives in ``dsaspec/bench/<module>.py`` with ``add_arguments(parser)`` and
``run(args) -> int``; it is registered in ``BENCHMARKS`` below. A :class:`~dsaspec.errors.UserError`
(bad option, environment variable or file) is printed as one line ``dsaspec: error: ...`` with exit
status 2; running out of GPU memory (a preset, batch or context too large for the device) as one
line with exit status 1; any other exception is a bug and keeps its traceback. A benchmark's
results folder (``--out``) is checked before anything is measured.
"""

from __future__ import annotations

import importlib
import sys

from dsaspec import __version__, flags
from dsaspec.errors import UserError
from dsaspec.cli_parsing import Parser

# name on the command line -> module under dsaspec.bench
BENCHMARKS = {
    "metadata": "metadata",
    "draft-metadata": "draft_metadata",
    "draft-step": "draft_step",
    "verify-step": "verify_step",
    "decode": "decode",
    "prefill": "prefill",
    "dsa-ops": "dsa_ops",
    "moe": "moe",
    "e2e": "e2e",
    "kv-accuracy": "kv_accuracy",
}


def build_parser() -> Parser:
    """The ``dsaspec`` parser with every subcommand. Import it only after
    :func:`dsaspec.flags.select_triton_interpreter` (the subcommands import triton)."""
    from dsaspec.commands import generate, serve

    parser = Parser(prog="dsaspec", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="run a benchmark and write benchmarks/results/<machine>/")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    modules = {name: importlib.import_module(f"dsaspec.bench.{module}") for name, module in BENCHMARKS.items()}
    for name, module in modules.items():
        p = bench_sub.add_parser(name, help=module.__doc__.strip().splitlines()[0], description=module.__doc__)
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    p_all = bench_sub.add_parser("all", help="every benchmark with its defaults, one after another")
    p_all.add_argument("--out", default=None,
                       help="results folder of every benchmark (default: benchmarks/results/<machine>)")
    p_all.set_defaults(run=lambda args: _run_all(modules, args))

    p = sub.add_parser("generate", help="greedy generation with the dsaspec runtime", description=generate.__doc__)
    generate.add_arguments(p)
    p.set_defaults(run=generate.run)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the runtime", description=serve.__doc__)
    serve.add_arguments(p)
    p.set_defaults(run=serve.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``dsaspec`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status (2 on a
    user error, printed as one line on stderr; 1 when the GPU runs out of memory, also one line)."""
    import torch

    try:
        from dsaspec.distributed.launch import worker_exit_status

        flags.select_triton_interpreter(torch.cuda.is_available())  # before anything imports triton
        args = build_parser().parse_args(argv)
        flags.check_all()
        if "out" in vars(args):                                      # every benchmark, and bench all
            from dsaspec.bench.results import check_results_dir

            check_results_dir(args.out)
        return worker_exit_status(int(args.run(args) or 0))
    except UserError as err:
        print(f"dsaspec: error: {err}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError as err:
        # torch's message: what was asked, what the device holds, then allocator advice
        asked = ". ".join(str(err).splitlines()[0].split(". ")[:3])
        print(f"dsaspec: error: out of GPU memory ({asked}): take a smaller --preset, batch or context",
              file=sys.stderr)
        return 1


def _run_all(modules: dict, args) -> int:
    status = 0
    for name, module in modules.items():
        print(f"== dsaspec bench {name}", flush=True)
        p = Parser(prog=f"dsaspec bench {name}")
        module.add_arguments(p)
        status |= int(module.run(p.parse_args([] if args.out is None else ["--out", args.out])) or 0)
    return status


if __name__ == "__main__":
    sys.exit(main())
