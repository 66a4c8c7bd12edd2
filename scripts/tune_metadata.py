"""Sweep the bounded metadata kernel's knobs at live 64k (target: the same-bytes copy, docs/benchmarking.md)
on a 1M-token table, for decode / target verify / draft extend and the 4-step MTP draft-decode
metadata (one launch, four destinations), at bs 4 and 16:

- row layout: ``contract`` (rows of W = 2^20 + 4 + N columns, what engines allocate: not 16-byte
  aligned) or ``aligned`` (page-table rows padded to a multiple of 4 columns,
  ``MetadataBuffers.allocate(row_align=4)``, and a ``req_to_token`` row stride padded the same way:
  16-byte vector loads and stores once a thread holds 4+ columns);
- ``block_cols`` x ``num_warps`` (columns per program step, warps per program);
- ``budget`` (programs per launch: fewer, longer-lived programs or more, shorter ones).

Each line: CUPTI median µs of the kernel in a CUDA graph with a cold L2 (100 replays), the
same-bytes device-to-device copy timed the same way, and their ratio (target <= 1.1). Ends with
the best variant per case. H200:

    python3 scripts/tune_metadata.py [--out DIR]

Writes ``tune_metadata.{json,md}`` to ``--out`` (default benchmarks/results/<machine>).
"""

from __future__ import annotations

import argparse
import sys

import torch

from dsaspec.bench.draft_metadata import floor_bytes
from dsaspec.bench.metadata import bytes_moved
from dsaspec.bench.results import bench_params, markdown_table, write_results
from dsaspec.bench.timing import copy_time_us, time_in_graph, warm_up_gpu
from dsaspec.ops.dsa_metadata import BLOCK_COLS, NUM_WARPS, bounded_metadata
from dsaspec.ops.dsa_metadata_common import MetadataBuffers
from dsaspec.forward_mode import Mode

LIVE = 65536
N = 5                       # verify / draft-extend rows per request (as in `bench metadata`)
DRAFT_STEPS = 4             # step backends of the draft-decode case
CONTEXT = 1 << 20
PAGE_SIZE, TOPK = 64, 2048
SHAPES = [(128, 4), (128, 2), (256, 2), (512, 4), (512, 2), (1024, 4)]  # (block_cols, num_warps)
BUDGETS = [1024, 2048, 4096]
CASES = [("decode", Mode.DECODE, 1, 1), ("target_verify", Mode.TARGET_VERIFY, N, 1),
         ("draft_extend", Mode.DRAFT_EXTEND, N, 1), ("draft_decode_4_steps", Mode.DECODE, 1, DRAFT_STEPS)]


def table_rows(pool: int, width: int, align: int, device) -> torch.Tensor:
    """A random req_to_token ``[pool, width]`` whose row stride is ``width`` rounded up to ``align``."""
    stride = -(-width // align) * align
    table = torch.empty(pool, stride, dtype=torch.int32, device=device)[:, :width]
    table.copy_(torch.randint(0, 1 << 30, (pool, width), dtype=torch.int32, device=device))
    return table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bs", type=int, nargs="+", default=[4, 16], help="batch sizes (default: %(default)s)")
    p.add_argument("--iters", type=int, default=100, help="timed graph replays per variant (default: %(default)s)")
    p.add_argument("--out", default=None, help="results folder (default: benchmarks/results/<machine>)")
    args = p.parse_args()
    device = torch.device("cuda")
    warm_up_gpu()
    rows = []
    for name, mode, n, dests in CASES:
        width = CONTEXT + 4 + (DRAFT_STEPS + 2 if dests > 1 else N)  # as in the two benchmarks
        for bs in args.bs:
            nbytes = (floor_bytes(bs, LIVE, dests) if dests > 1
                      else bytes_moved(mode, bs, LIVE, n, PAGE_SIZE))
            copy_us = copy_time_us(nbytes, iters=args.iters)
            idx = torch.arange(bs, device=device)
            seq_lens = torch.full((bs,), LIVE, dtype=torch.int32, device=device)
            for layout, align in (("contract", 1), ("aligned", 4)):
                table = table_rows(bs + 1, width, align, device)
                outs = [MetadataBuffers.allocate(mode, bs, width, PAGE_SIZE, device, num_draft_tokens=n,
                                                 row_align=align) for _ in range(dests)]
                for block_cols, num_warps in SHAPES:
                    for budget in BUDGETS:
                        def launch():
                            bounded_metadata(mode, table, idx, seq_lens, outs, index_topk=TOPK, page_size=PAGE_SIZE,
                                             num_draft_tokens=n, budget=budget, block_cols=block_cols,
                                             num_warps=num_warps, check_values=False)

                        us = time_in_graph(launch, iters=args.iters, graph_diff=False).median_us
                        row = {"case": name, "bs": bs, "layout": layout, "block_cols": block_cols,
                               "num_warps": num_warps, "budget": budget, "kernel_us": us, "copy_us": copy_us,
                               "over_copy": us / copy_us, "bytes": nbytes,
                               "default": (layout, block_cols, num_warps, budget) == ("contract", BLOCK_COLS,
                                                                                      NUM_WARPS, 2048)}
                        rows.append(row)
                        print(f"{name:21s} bs {bs:3d} {layout:8s} block {block_cols:4d} warps {num_warps} "
                              f"budget {budget:5d}: {us:7.2f} us  copy {copy_us:6.2f} us  {us / copy_us:5.2f}x"
                              + ("  (default)" if row["default"] else ""), flush=True)
    best = []
    for name, *_ in CASES:
        for bs in args.bs:
            pts = [r for r in rows if r["case"] == name and r["bs"] == bs]
            top = min(pts, key=lambda r: r["kernel_us"])
            default = next((r for r in pts if r["default"]), {})
            best.append({"case": name, "bs": bs, "copy_us": top["copy_us"], "default_us": default.get("kernel_us"),
                         "default_over_copy": default.get("over_copy"), "best_us": top["kernel_us"],
                         "best_over_copy": top["over_copy"], "best": (f"{top['layout']} block {top['block_cols']} "
                                                                     f"warps {top['num_warps']} budget {top['budget']}")})
    cols = [("case", "case"), ("bs", "bs"), ("copy_us", "copy µs"), ("default_us", "default µs"),
            ("default_over_copy", "default / copy"), ("best_us", "best µs"), ("best_over_copy", "best / copy"),
            ("best", "best variant")]
    md = markdown_table(cols, best)
    payload = {"method": f"bounded_metadata at live {LIVE}, 1M-token table, N = {N}; CUPTI median of {args.iters} "
                         "CUDA-graph replays with a cold L2; copy = one device-to-device memcpy of the same bytes, "
                         "timed the same way.", "params": bench_params(args), "best": best, "rows": rows}
    write_results("tune_metadata", payload, md, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
