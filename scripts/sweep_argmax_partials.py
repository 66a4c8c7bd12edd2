"""Sweep the argmax-partials kernel's launch shape (columns per program, tile, warps) on one GPU at
target-verify sizes: rows 64/128/256 of a TP 2 vocab shard (77440 bf16 logits per row), warm L2 (in
the verify step the LM-head GEMM has just written the logits). Prints one line per configuration
and writes ``sweep_argmax_partials.json`` to the folder given as the first argument (default: .).
Next to them, timed the same way over the same logits: ``torch.amax`` and ``torch.argmax`` along
the row (same-bytes reductions: the yardstick of what one read of the shard's logits costs).

    python3 scripts/sweep_argmax_partials.py $OUT [--quick]   # --quick: the default and two other shapes
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

from dsaspec.bench.timing import time_in_graph, warm_up_gpu
from dsaspec.ops import argmax_exchange as ax

SHARD = 154880 // 2
TP = 2


def main() -> int:
    parser = argparse.ArgumentParser(description="Launch shapes of the argmax-partials kernel at verify sizes.")
    parser.add_argument("out", nargs="?", type=Path, default=Path("."), help="folder for sweep_argmax_partials.json")
    parser.add_argument("--quick", action="store_true", help="only the default shape and two others")
    args = parser.parse_args()
    out_dir = args.out
    shapes = list(itertools.product((4096, 8192, 16384, 38720), (1024, 2048, 4096), (4, 8, 16)))
    if args.quick:  # the default shape and the two best of the full sweep at 256 rows
        shapes = [(ax.DEFAULT_SPLIT_COLUMNS, ax._ARGMAX_BLOCK, 4), (38720, 2048, 8), (16384, 1024, 4)]
    warm_up_gpu()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for rows in (64, 128, 256):
        logits = torch.randn(rows, SHARD, device="cuda", generator=gen).bfloat16()
        bits = logits.view(torch.int16)
        want = None
        for split_columns, block, warps in shapes:
            splits, width = ax.exchange_layout(SHARD, split_columns)
            if block > triton.next_power_of_2(width):
                continue
            buf = torch.zeros(rows, TP * splits, 4, device="cuda")

            def run(buf=buf, splits=splits, width=width, block=block, warps=warps):
                ax._argmax_partials_kernel[(rows, splits)](
                    bits, buf, bits.stride(0), buf.stride(0), SHARD, width, 0, 0, TP, splits,
                    IS_BF16=True, BLOCK=block, TP_P2=TP, num_warps=warps)

            timing = time_in_graph(run, iters=100, cold_l2=False, graph_diff=False)
            tokens = buf.view(rows, TP * splits, 4)[:, :splits]
            best = (tokens[..., 2].long() << 16 | tokens[..., 3].long())
            keys = (tokens[..., 0].long() << 16 | tokens[..., 1].long())
            pick = best.gather(1, keys.argmax(1, keepdim=True)).squeeze(1)
            want = logits.float().argmax(1) if want is None else want
            ok = bool(torch.equal(pick, want))
            row = dict(rows=rows, split_columns=split_columns, splits=splits, block=block, num_warps=warps,
                       us=timing.median_us, spread=timing.spread, argmax_ok=ok)
            results.append(row)
            print(json.dumps(row), flush=True)
        for name, reduce in (("torch.amax", torch.amax), ("torch.argmax", torch.argmax)):
            timing = time_in_graph(lambda reduce=reduce: reduce(logits, dim=1), iters=100, cold_l2=False,
                                   graph_diff=False)
            row = dict(rows=rows, reduction=name, us=timing.median_us, spread=timing.spread)
            results.append(row)
            print(json.dumps(row), flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep_argmax_partials.json").write_text(json.dumps(results, indent=1) + "\n")
    for rows in (64, 128, 256):
        mine = sorted((r for r in results if r["rows"] == rows and "block" in r), key=lambda r: r["us"])
        default = next(r for r in mine if r["split_columns"] == ax.DEFAULT_SPLIT_COLUMNS
                       and r["block"] == ax._ARGMAX_BLOCK and r["num_warps"] == 4)
        same_bytes = {r["reduction"]: round(r["us"], 2) for r in results if r["rows"] == rows and "reduction" in r}
        print(f"rows {rows}: default {default['us']:.2f} us; best {mine[0]}; same bytes {same_bytes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
