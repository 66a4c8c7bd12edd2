"""Top-k at long rows on one GPU (k = 2048, 64k live tokens per row, cold L2, CUDA graphs):

1. how the logits' keys spread over the first radix digit's 256 bins matters: normal logits
   (a handful of bins hold 90% of the keys) against random bit patterns (all bins);
2. the launch shape of the one-program-per-row form (loop step, warps) at 64 and 256 rows, next to
   the chunked form the op picks; each result checked against the op's default output.

Next to each: ``torch.amax`` over the same logits, timed the same way (one read of the bytes).
Writes ``sweep_topk.json`` into the folder given as the first argument (default: .).

    python3 scripts/sweep_topk.py $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

from dsaspec.bench.timing import time_in_graph, warm_up_gpu
from dsaspec.ops import topk as topk_module
from dsaspec.ops.order_key import fp32_order_key
from dsaspec.ops.topk import topk_slots, topk_workspace

K, LIVE = 2048, 65536
SHAPES = ((4096, 8), (4096, 4), (2048, 8), (2048, 4), (1024, 4), (1024, 2))  # (loop step, warps)


def _us(fn) -> float:
    return time_in_graph(fn, iters=50, cold_l2=True, graph_diff=False).median_us


def _random_bit_logits(rows: int, gen, device) -> torch.Tensor:
    """Finite fp32 values with uniformly random bits (exponent 255 moved down one)."""
    bits = torch.randint(0, 1 << 32, (rows, LIVE), device=device, dtype=torch.int64, generator=gen)
    bits = torch.where((bits & 0x7F800000) == 0x7F800000, bits & ~0x00800000, bits)
    return (bits - (bits >= 1 << 31).long() * (1 << 32)).to(torch.int32).view(torch.float32)


def main() -> int:
    parser = argparse.ArgumentParser(description="Top-k at long rows: key spread and launch shapes.")
    parser.add_argument("out", nargs="?", type=Path, default=Path("."), help="folder for sweep_topk.json")
    out_dir = parser.parse_args().out
    warm_up_gpu()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    results = []
    for rows in (1, 16, 64, 256):
        table = torch.randint(0, 1 << 24, (rows, LIVE), device=device, dtype=torch.int32, generator=gen)
        seqlens = torch.full((rows,), LIVE, device=device, dtype=torch.int32)
        out = torch.empty(rows, K, device=device, dtype=torch.int32)
        workspace = topk_workspace(rows, device)
        for name, logits in (("normal", torch.randn(rows, LIVE, device=device, generator=gen)),
                             ("random_bits", _random_bit_logits(rows, gen, device))):
            keys = fp32_order_key(logits)
            counts = torch.bincount((keys >> 24).flatten(), minlength=256).sort(descending=True).values
            bins = int((counts.cumsum(0) < 0.9 * counts.sum()).sum()) + 1

            def default(logits=logits):
                topk_slots(logits, seqlens, table, K, out, check_values=False, workspace=workspace)

            row = dict(part="key_spread", rows=rows, logits=name, bins_for_90pct_of_keys=bins,
                       chunks=1 if workspace is None else workspace.shape[1], us=_us(default),
                       amax_us=_us(lambda logits=logits: torch.amax(logits, dim=1)))
            results.append(row)
            print(json.dumps(row), flush=True)
            if rows < 64 or name != "normal":
                continue
            default()
            want = out.clone()
            for block, warps in SHAPES:
                def one_program(logits=logits, block=block, warps=warps):
                    topk_module._topk_slots_kernel[(rows,)](
                        logits, seqlens, table, out, out, logits.stride(0), table.stride(0), out.stride(0),
                        out.stride(0), K, K, WRITE_POSITIONS=False, BLOCK=block,
                        BLOCK_K=min(block, triton.next_power_of_2(K)), num_warps=warps)

                out.fill_(-7)
                one_program()
                row = dict(part="one_program_shape", rows=rows, block=block, num_warps=warps,
                           us=_us(one_program), matches_default=bool(torch.equal(out, want)))
                results.append(row)
                print(json.dumps(row), flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep_topk.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
