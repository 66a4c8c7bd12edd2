"""Sweep the fused MoE's grouped-GEMM tiles on one GPU at decode / verify token counts: for each
(T tokens, intermediate size I) and each candidate tile (BLOCK_N, BLOCK_K, stages, warps), applied
to both grouped GEMMs, the per-kernel device times of a cold-L2 CUDA-graph replay (CUPTI medians),
next to the default tile's. E 256 experts, k 8, H 7168, bf16 activations, the inputs of ``dsaspec
bench moe``; ``--weight-dtype fp8``: its FP8 experts (e4m3, 128 x 128 block scales), whose K step is
the 128-column scale block, so only ``BLOCK_K`` 128 is tried. ``--align CxW,...``: the align
programs' pair chunk C and warps W instead of the tiles (the sorted layout, T * 8 > 64 pairs), the
layout checked against the default's. Prints the best tile (or align form) per kernel and point;
writes ``sweep_fused_moe.json`` to the folder given.

    python3 scripts/sweep_fused_moe.py $OUT [--tokens 1,2,4,8,16,64] [--intermediate 256] [--weight-dtype fp8]
    python3 scripts/sweep_fused_moe.py $OUT --tokens 16,32,64,128,512 --align 1024x4,512x4,256x4,2048x4,1024x8
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from dsaspec.bench.moe import _inputs, quantize_experts
from dsaspec.bench.timing import replay_events, warm_up_gpu
from dsaspec.cli_parsing import Parser, parse_or_exit, positive_int, positive_int_list
from dsaspec.ops import fused_moe as moe

KERNELS = {"gate_up": "_gate_up_kernel", "down": "_down_kernel", "align": "_align_kernel",
           "combine": "_combine_kernel", "act_quant": "_act_quant_kernel"}  # act_quant: FP8 only
SMEM_BYTES = 220 * 1024


def _kernel_medians(fn, iters: int) -> dict[str, float]:
    """Median device µs per replay of each fused-MoE kernel."""
    per = {name: [] for name in KERNELS}
    for replay in replay_events(fn, iters=iters):
        for name, pattern in KERNELS.items():
            per[name].append(sum(e - s for n, s, e in replay if pattern in n) / 1e3)
    return {name: statistics.median(v) for name, v in per.items()}


def _align_forms(text: str) -> list[tuple[int, int]]:
    """``"1024x4,512x8"`` -> [(1024, 4), (512, 8)]: pair chunks and warps, powers of two."""
    forms = []
    for item in text.split(","):
        chunk, _, warps = item.partition("x")
        if not (chunk.isdigit() and warps.isdigit()) or any(v < 1 or v & (v - 1) for v in (int(chunk), int(warps))):
            raise ValueError(f"expected CHUNKxWARPS pairs of powers of two, got {item!r}")
        forms.append((int(chunk), int(warps)))
    return forms


def _sweep_align(run, workspace, forms, iters: int) -> list[dict]:
    """The align kernel's median µs per form (pair chunk, warps) and whether its layout is the
    default form's; printed a line per form."""
    default = (moe._ALIGN_PAIR_CHUNK, moe._ALIGN_WARPS)
    run()
    want = (workspace.sorted_pairs.clone(), workspace.block_experts.clone())
    out = []
    for chunk, warps in forms:
        moe._ALIGN_PAIR_CHUNK, moe._ALIGN_WARPS = chunk, warps
        try:
            us = _kernel_medians(run, iters)["align"]
            same = (torch.equal(workspace.sorted_pairs, want[0]) and torch.equal(workspace.block_experts, want[1]))
        finally:
            moe._ALIGN_PAIR_CHUNK, moe._ALIGN_WARPS = default
        print(f"align pair chunk {chunk:4d} warps {warps}: {us:7.2f} us, layout identical {same}", flush=True)
        out.append({"pair_chunk": chunk, "warps": warps, "us": us, "layout_identical": same})
    return out


def main() -> int:
    parser = Parser(prog="sweep_fused_moe", description="Tiles of the fused MoE's grouped GEMMs.")
    parser.add_argument("out", type=Path, help="folder for sweep_fused_moe.json")
    parser.add_argument("--tokens", type=positive_int_list, default=[1, 2, 4, 8, 16, 64], help="T values")
    parser.add_argument("--intermediate", type=positive_int_list, default=[256], help="I values")
    parser.add_argument("--iters", type=positive_int, default=50, help="timed replays per point")
    parser.add_argument("--weight-dtype", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--align", type=_align_forms, default=None,
                        help="sweep the align programs instead: pair chunk x warps, e.g. 1024x4,512x8")
    args = parse_or_exit(parser)
    fp8 = args.weight_dtype == "fp8"
    shape = SimpleNamespace(hidden=7168, experts=256, topk=8, seed=0)
    default_tile = moe._tile
    candidates = [moe._Tile(bn, bk, w, st) for bn, bk, st, w in
                  itertools.product((16, 32, 64), (128,) if fp8 else (64, 128, 256), (3, 4, 6), (2, 4))]
    itemsize = 1 if fp8 else 2
    warm_up_gpu()
    results = []
    for inter, tokens in itertools.product(args.intermediate, args.tokens):
        hidden, w13, w2, ids, weights = _inputs(tokens, shape, inter, "cuda", torch.bfloat16)
        scales = {}
        if fp8:
            (w13, scales["w13_scale"]), (w2, scales["w2_scale"]) = quantize_experts(w13), quantize_experts(w2)
        workspace = moe.fused_moe_workspace(tokens, 8, 256, 7168, inter, "cuda", torch.bfloat16, fp8=fp8)
        out = torch.empty_like(hidden)
        want = moe.fused_moe(hidden, w13, w2, ids, weights, out.clone(), workspace=workspace, **scales)

        def run():
            moe.fused_moe(hidden, w13, w2, ids, weights, out, workspace=workspace, check_values=False, **scales)

        moe._tile = default_tile
        point = {"tokens": tokens, "intermediate": inter, "weight_dtype": args.weight_dtype,
                 "default": _kernel_medians(run, args.iters), "tiles": []}
        if args.align is not None:
            point["align"] = _sweep_align(run, workspace, args.align, args.iters)
            results.append(point)
            continue
        for tile in candidates:
            def fixed(*args, tile=tile, **kwargs):   # every GEMM of the call on this tile
                return tile
            if (16 + 2 * tile.block_n) * tile.block_k * itemsize * tile.num_stages > SMEM_BYTES:
                continue
            moe._tile = fixed
            try:
                times = _kernel_medians(run, args.iters)
            except Exception as err:  # a tile the compiler refuses (resources): recorded, skipped
                point["tiles"].append({"tile": dataclasses.astuple(tile), "error": type(err).__name__})
                continue
            # Different tiles change the fp32 summation order only where a K block differs.
            max_diff = float((out.float() - want.float()).abs().max())
            point["tiles"].append({"tile": dataclasses.astuple(tile), "times": times, "max_diff": max_diff})
        moe._tile = default_tile
        ok = [t for t in point["tiles"] if "times" in t]
        for kernel in ("gate_up", "down"):
            best = min(ok, key=lambda t: t["times"][kernel])
            print(f"T {tokens:3d} I {inter:4d} {kernel:8s} default {point['default'][kernel]:7.2f} us  "
                  f"best {best['times'][kernel]:7.2f} us with {best['tile']}", flush=True)
        results.append(point)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep_fused_moe.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
