"""Compile the replay-metadata kernels for sm_90 without a GPU and record, per mode and batch, the
compile time, registers and spills: what a server capturing CUDA graphs for batch 1..256 pays at
start-up.

Each case calls the real host wrapper (``bounded_metadata``, ``context_wide_metadata``) on small
CPU tensors of the production row alignment (W = 1024 + 4 + N, the residue of 2^20 + 4 + N mod 16);
the launch is intercepted and compiled offline exactly as Triton's JIT would specialize it
(its own binder), for ``GPUTarget("cuda", 90, 32)`` with the wheel's ptxas, in a fresh cache so
every compile is cold. Registers and spills come from the ptxas log.

    python3 scripts/compile_metadata.py [--bs 1 2 4 ...] [--out benchmarks/results]

Writes ``compile_metadata.{json,md}``. Needs no GPU and no driver (runs on a CPU-only machine);
on a GPU machine it compiles for sm_90 just the same.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile, never interpret (set before triton is imported)
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="dsaspec-compile-")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from dsaspec.bench.results import RESULTS_ROOT, machine_info, markdown_table  # noqa: E402
from dsaspec.ops import dsa_metadata, dsa_metadata_bounded  # noqa: E402
from dsaspec.ops.dsa_metadata_common import MetadataBuffers, Mode  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
N = 8  # draft tokens: rows up to 256 x 8
DEFAULT_BS = [1, 2, 3, 4, 8, 16, 32, 64, 100, 128, 255, 256]
CASES = [  # (kernel label, mode, variable extend, destinations)
    ("bounded", Mode.DECODE, False, 1),
    ("bounded", Mode.DECODE, False, 4),
    ("bounded", Mode.TARGET_VERIFY, False, 1),
    ("bounded", Mode.DRAFT_EXTEND, False, 1),
    ("bounded", Mode.DRAFT_EXTEND, True, 1),
    ("bounded", Mode.DRAFT_EXTEND, True, 4),
    ("context_wide", Mode.DECODE, False, 1),
    ("context_wide", Mode.TARGET_VERIFY, False, 1),
    ("context_wide", Mode.DRAFT_EXTEND, False, 1),
    ("context_wide", Mode.DRAFT_EXTEND, True, 1),
]
PTXAS = {
    "regs": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "stack_bytes": re.compile(r"(\d+) bytes stack frame"),
}


@contextlib.contextmanager
def compile_instead_of_launch(kernel, record: dict, keep_compiled: bool = False):
    """While active, a launch of ``kernel`` (a Triton or a Gluon kernel) compiles it for
    :data:`TARGET` (as the JIT would specialize these arguments) and stores the result in
    ``record`` instead of running it (with ``knobs.nvidia.dump_ptxas_log`` set, registers and
    spills from the ptxas log; with ``keep_compiled``, the compiled kernel under
    ``"compiled"``)."""
    backend = make_backend(TARGET)
    source = GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)

    def run(*args, grid, warmup, **kwargs):
        kwargs.update(debug=False, instrumentation_mode=knobs.compilation.instrumentation_mode)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization,
                                                                  options)
        log = io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(source(kernel, signature, constexprs, attrs), target=TARGET,
                                      options=options.__dict__)
        record["compile_s"] = time.perf_counter() - start
        for key, pattern in PTXAS.items():
            found = pattern.findall(log.getvalue())
            record[key] = int(found[-1]) if found else None
        ptx = compiled.asm["ptx"]
        record["ptx_lines"] = ptx.count("\n")
        record["grid"] = grid[0]
        if keep_compiled:
            record["compiled"] = compiled

    kernel.run = run
    try:
        yield
    finally:
        del kernel.run


def compile_case(label: str, mode: Mode, variable: bool, dests: int, bs: int) -> dict:
    n = 1 if mode is Mode.DECODE else N
    width = 1024 + 4 + N
    table = torch.zeros(bs + 1, width, dtype=torch.int32)
    idx = torch.arange(bs, dtype=torch.int32)
    seq_lens = torch.ones(bs, dtype=torch.int32)
    ext = torch.full((bs,), n, dtype=torch.int32) if variable else None
    outs = [MetadataBuffers.allocate(mode, bs, width, 64, "cpu", num_draft_tokens=n) for _ in range(dests)]
    kw = dict(index_topk=2048, page_size=64, num_draft_tokens=n, extend_seq_lens=ext, check_values=False)
    row = {"kernel": label, "mode": mode.value + (" (variable)" if variable else ""), "destinations": dests,
           "bs": bs, "rows": outs[0].rows}
    if label == "bounded":
        with compile_instead_of_launch(dsa_metadata_bounded._bounded_kernel, row):
            dsa_metadata_bounded.bounded_metadata(mode, table, idx, seq_lens, outs, budget=2048, **kw)
    else:
        with compile_instead_of_launch(dsa_metadata._context_wide_kernel, row):
            dsa_metadata.context_wide_metadata(mode, table, idx, seq_lens, outs[0], **kw)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bs", type=int, nargs="+", default=DEFAULT_BS, help="batch sizes (default: %(default)s)")
    p.add_argument("--out", default=str(RESULTS_ROOT), help="results folder (default: %(default)s)")
    args = p.parse_args()
    knobs.nvidia.dump_ptxas_log = True
    compile_case(*CASES[0], 2)  # warm-up: the first compile also loads the compiler
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="dsaspec-compile-")
    rows = []
    for label, mode, variable, dests in CASES:
        for bs in args.bs:
            row = compile_case(label, mode, variable, dests, bs)
            rows.append(row)
            print(f"{label:12s} {row['mode']:25s} dest {dests} bs {bs:4d} rows {row['rows']:5d}: "
                  f"{row['compile_s']:6.2f} s, {row['regs']} regs, spill {row['spill_stores']} B", flush=True)
    info = machine_info()
    ptxas = knobs.nvidia.ptxas.version
    method = (f"triton.compile for sm_90 ({TARGET}), ptxas {ptxas} from the Triton wheel, cold cache per "
              f"compile, arguments specialized by Triton's own binder from the real host wrapper's launch; "
              f"N = {N} rows per request (verify / draft extend), budget 2048, page size 64, W = 1024 + 4 + N "
              f"(the row alignment of 2^20 + 4 + N). Registers and spills from the ptxas log.")
    payload = {"benchmark": "compile_metadata", "machine": info, "method": method, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile_metadata.json").write_text(json.dumps(payload, indent=2) + "\n")
    cols = [("kernel", "kernel"), ("mode", "mode"), ("destinations", "destinations"), ("bs", "bs"),
            ("rows", "rows"), ("compile_s", "compile s"), ("regs", "registers"),
            ("spill_stores", "spill stores B"), ("spill_loads", "spill loads B"), ("stack_bytes", "stack B")]
    worst = max(rows, key=lambda r: r["compile_s"])
    spilling = [r for r in rows if r["spill_stores"]]
    summary = (f"Slowest compile: {worst['kernel']} {worst['mode']} bs {worst['bs']}: {worst['compile_s']:.2f} s. "
               + (f"{len(spilling)} cases spill." if spilling else "No case spills."))
    md = (f"# compile_metadata\n\nMachine: {info['host']} (compiled offline for sm_90, no GPU used), torch "
          f"{info['torch']}, triton {info['triton']}, {info['date']}.\n\nCommand: `{info['command']}`\n\n"
          f"Method: {method}\n\n{summary}\n\n" + markdown_table(cols, rows) + "\n")
    (out / "compile_metadata.md").write_text(md)
    print(summary)
    print(f"results: {out / 'compile_metadata.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
