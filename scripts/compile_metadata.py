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
import json
import sys
from pathlib import Path

from dsaspec.testing.offline_compile import (compile_instead_of_launch, compile_only_environment,
                                             fresh_cache_dir, sm90_target)

compile_only_environment()  # before triton is imported

import torch  # noqa: E402
from triton import knobs  # noqa: E402

from dsaspec.bench.results import RESULTS_ROOT, machine_info, markdown_table  # noqa: E402
from dsaspec.ops import dsa_metadata  # noqa: E402
from dsaspec.ops.baseline import dsa_metadata as baseline_metadata  # noqa: E402
from dsaspec.ops.dsa_metadata_common import MetadataBuffers  # noqa: E402
from dsaspec.forward_mode import Mode  # noqa: E402

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
        with compile_instead_of_launch(dsa_metadata._bounded_kernel, row):
            dsa_metadata.bounded_metadata(mode, table, idx, seq_lens, outs, budget=2048, **kw)
    else:
        with compile_instead_of_launch(baseline_metadata._context_wide_kernel, row):
            baseline_metadata.context_wide_metadata(mode, table, idx, seq_lens, outs[0], **kw)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bs", type=int, nargs="+", default=DEFAULT_BS, help="batch sizes (default: %(default)s)")
    p.add_argument("--out", default=str(RESULTS_ROOT), help="results folder (default: %(default)s)")
    args = p.parse_args()
    knobs.nvidia.dump_ptxas_log = True
    compile_case(*CASES[0], 2)  # warm-up: the first compile also loads the compiler
    fresh_cache_dir()
    rows = []
    for label, mode, variable, dests in CASES:
        for bs in args.bs:
            row = compile_case(label, mode, variable, dests, bs)
            rows.append(row)
            print(f"{label:12s} {row['mode']:25s} dest {dests} bs {bs:4d} rows {row['rows']:5d}: "
                  f"{row['compile_s']:6.2f} s, {row['regs']} regs, spill {row['spill_stores']} B", flush=True)
    info = machine_info()
    ptxas = knobs.nvidia.ptxas.version
    method = (f"triton.compile for sm_90 ({sm90_target()}), ptxas {ptxas} from the Triton wheel, cold cache per "
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
