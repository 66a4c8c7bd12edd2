"""Time MLA's absorbed query (``mla_query``: ``q_nope`` times its head's ``W_UK``, ``q_rope`` rotated,
``[R, H, 576]``) on one GPU at a preset's heads and ``--rows`` row counts (prefill chunks by default,
decode rows to compare decode tiles), in every form side by side: the kernel with each ``--tiles``
tile (``BLOCK_M x BLOCK_N x warps x stages``; every tile sums K in the same 64-wide blocks, in
order, on MMA instructions its shape picks) and
cuBLAS's bmm writing the product into the output's view, then the kernel's RoPE programs alone
(``cublas``). Per point: the median per-replay span of a cold-L2 CUDA-graph replay (time_in_graph),
against the bytes floor (``q`` read, ``W_UK`` read, the output written, at the measured copy
bandwidth) and the FLOP floor (``2 R H D 512`` at the measured bf16 tensor-core rate); each form's
largest error against a float64 product relative to ``sum |q w|``, whether its product's bits equal
the first tile's (a decode tile must keep them: the row-invariant mode's bits depend on it), and its
RoPE columns checked equal to the first tile's. Writes
``mla_query_<preset>.json`` and ``.md`` to the folder given.

    python3 scripts/bench_mla_query.py OUT [--preset glm5-fp8-tp8-rank] [--rows 512,1024,4096]
        [--tiles 64x128x4x3,64x64x4x3,128x128x8x3]
"""

from __future__ import annotations

import argparse
import sys

import torch

from dsaspec.bench.floors import matmul_tflops
from dsaspec.bench.results import markdown_table, write_results
from dsaspec.bench.timing import measured_floors_or_none, time_in_graph
from dsaspec.cli_parsing import Parser, parse_or_exit, positive_int, positive_int_list
from dsaspec.configs.model_config import PRESETS
from dsaspec.forward_mode import PREFILL_MIN_ROWS
from dsaspec.ops import mla_latent as op

METHOD = ("CUDA-graph replays with a cold L2 (time_in_graph), median per-replay device span; every form on the same "
          "inputs; floor = max(bytes (q, W_UK read, output written) / measured copy bandwidth, 2 R H D 512 FLOPs / "
          "measured bf16 tensor-core rate)")


def parse_tile(text: str) -> tuple[int, int, int, int]:
    """``BMxBNxWxS`` -> ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``, each a power of two (stages any)."""
    parts = text.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"expected BLOCK_MxBLOCK_NxWARPSxSTAGES, got {text!r}")
    tile = tuple(int(p) for p in parts)
    if any(v & (v - 1) for v in tile[:3]) or op.MLA_LATENT_DIM % tile[1]:
        raise ValueError(f"BLOCK_M, BLOCK_N and warps must be powers of two, BLOCK_N <= 512, got {text!r}")
    return tile


def tile_list(text: str) -> list[tuple[int, int, int, int]]:
    """argparse type: comma-separated tiles (:func:`parse_tile`)."""
    try:
        return [parse_tile(t) for t in text.split(",") if t]
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def launch_tiles(tile: tuple[int, int, int, int]) -> tuple[int, int, int, int, int]:
    """A ``--tiles`` tile as :func:`~dsaspec.ops.mla_latent.launch_mla_query` takes it, with the bf16 K block."""
    block_k = op.mla_query_tiles(PREFILL_MIN_ROWS, torch.bfloat16, False)[2]
    return tile[0], tile[1], block_k, tile[2], tile[3]


def main() -> int:
    parser = Parser(prog="bench_mla_query", description="MLA's absorbed query: tiles vs cuBLAS.")
    parser.add_argument("out", help="folder for mla_query_<preset>.json / .md")
    parser.add_argument("--preset", default="glm5-fp8-tp8-rank", choices=sorted(PRESETS))
    parser.add_argument("--rows", type=positive_int_list, default=[512, 1024, 4096], help="rows, comma-separated")
    parser.add_argument("--tiles", type=tile_list, default=[op.PREFILL_TILE, (64, 64, 4, 3), (128, 128, 8, 3)],
                        help="tiles BLOCK_MxBLOCK_NxWARPSxSTAGES, comma-separated (the first is the "
                             "reference for the RoPE columns and the cuBLAS form's RoPE tile)")
    parser.add_argument("--iters", type=positive_int, default=100, help="timed replays per point")
    args = parse_or_exit(parser)
    floors = measured_floors_or_none("bench_mla_query")
    if floors is None:
        return 2
    tflops = matmul_tflops(torch.bfloat16)
    config = PRESETS[args.preset]
    heads, nope = config.num_attention_heads, config.qk_nope_head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    w_uk = (torch.randn(heads, nope, op.MLA_LATENT_DIM, generator=gen, device="cuda") / 16).bfloat16()
    rows_out = []
    for rows in args.rows:
        q = torch.randn(rows, heads, nope + op.MLA_ROPE_DIM, generator=gen, device="cuda").bfloat16()
        angles = torch.rand(rows, op.MLA_ROPE_DIM // 2, generator=gen, device="cuda") * 100
        cos, sin = angles.cos(), angles.sin()
        exact = torch.einsum("rhd,hdn->rhn", q[..., :nope].double(), w_uk.double())
        scale = torch.einsum("rhd,hdn->rhn", q[..., :nope].double().abs(), w_uk.double().abs())
        nbytes = (q.numel() + w_uk.numel() + rows * heads * (op.MLA_LATENT_DIM + op.MLA_ROPE_DIM)) * 2
        flops = 2 * rows * heads * nope * op.MLA_LATENT_DIM
        floor_us = max(floors.floor_us(nbytes), flops / (tflops * 1e6))
        def new_out():
            return torch.empty(rows, heads, op.MLA_LATENT_DIM + op.MLA_ROPE_DIM, dtype=q.dtype, device="cuda")

        forms = {}
        for tile in args.tiles:
            out = new_out()
            forms["x".join(map(str, tile))] = (out, lambda out=out, tile=tile: op.launch_mla_query(
                q, w_uk, cos, sin, False, out, launch_tiles(tile), True))
        out = new_out()

        def cublas(out=out):
            torch.bmm(q[..., :nope].transpose(0, 1), w_uk, out=out[..., :op.MLA_LATENT_DIM].transpose(0, 1))
            op.launch_mla_query(q, w_uk, cos, sin, False, out, launch_tiles(args.tiles[0]), False)

        forms["cublas"] = (out, cublas)
        reference = None
        first_product = None
        for name, (out, fn) in forms.items():
            timing = time_in_graph(fn, iters=args.iters)
            fn()
            torch.cuda.synchronize()
            if reference is None:
                reference = out[..., op.MLA_LATENT_DIM:].clone()
                first_product = out[..., :op.MLA_LATENT_DIM].clone()
            error = ((out[..., :op.MLA_LATENT_DIM].double() - exact).abs() / scale.clamp_min(1e-30)).max().item()
            rows_out.append({
                "rows": rows, "heads": heads, "nope": nope, "form": name, "median_us": timing.median_us,
                "spread": timing.spread, "floor_us": floor_us, "over_floor": timing.median_us / floor_us,
                "bytes": nbytes, "flops": flops, "max_rel_error": error,
                "rope_equal": bool(torch.equal(out[..., op.MLA_LATENT_DIM:], reference)),
                "product_equal": bool(torch.equal(out[..., :op.MLA_LATENT_DIM], first_product)),
            })
            print(f"rows {rows} {name}: {timing.median_us:.2f} us (floor {floor_us:.2f}), error {error:.2e}",
                  flush=True)
    if not all(r["rope_equal"] for r in rows_out):
        print("bench_mla_query: error: RoPE columns differ between forms", file=sys.stderr)
        return 1
    table = markdown_table([("rows", "rows"), ("heads", "heads"), ("form", "form"), ("median_us", "median µs"),
                            ("spread", "spread"), ("floor_us", "floor µs"), ("over_floor", "x floor"),
                            ("error", "max rel error"), ("product_equal", "product bits = first tile's")],
                           [r | {"error": f"{r['max_rel_error']:.1e}"} for r in rows_out])
    write_results(f"mla_query_{args.preset}", {
        "method": METHOD, "preset": args.preset, "copy_gbps": floors.copy_gbps, "bf16_tflops": tflops,
        "rows": rows_out}, f"mla_query, {args.preset} (heads per rank {heads}):\n\n{table}\n",
                  args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
