"""Time the MoE router's GEMM (fp32 logits of the hidden rows against the gate weight) on one GPU at
the router shapes of the per-rank presets and T tokens: ``router_logits`` in several tiles
(:class:`~dsaspec.ops.moe_router.RouterGemmConfig`) on the fp32 weight and on its bf16 copy (the
Router's where exact: half the bytes, the same logits; one row per weight dtype), against cuBLAS on
``x.float()`` (the copy included: the default mode's path for prefill rows where the weight is not
bf16), cuBLAS's bf16 GEMM with fp32 output on the bf16 weight (the default mode's from
``BF16_GEMM_MIN_TOKENS`` rows; the weights here hold bf16 values, as the checkpoints' gate weights)
and the row-invariant GEMM on ``x.float()`` (16 x 32 FMA tiles, split K). Per point: the median
per-replay span of a cold-L2 CUDA-graph replay (time_in_graph), each against the bytes floor (the
tiles' weight, the bf16 rows read, the fp32 logits written, at the measured copy bandwidth; no
launch beats an empty kernel node), and every result checked within fp32 rounding of cuBLAS's.
Writes ``router_gemm.json`` and ``.md`` to the folder given: the tile that wins over all T is the
row-invariant mode's (one tile for every T), the best tile at each T the default mode's
(``dsaspec.ops.moe_router._DECODE_TILES``), where cuBLAS starts winning ``DECODE_MAX_TOKENS`` and
where its bf16 GEMM does ``dsaspec.layers.moe.BF16_GEMM_MIN_TOKENS``.

    python3 scripts/bench_router_gemm.py OUT [--rows 1,2,3,4,16,32,64,128,256] [--weight-dtype bf16,fp32]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from dsaspec.bench.results import markdown_table, write_results
from dsaspec.bench.timing import measured_floors_or_none, time_in_graph
from dsaspec.cli_parsing import Parser, choice_list, parse_or_exit, positive_int, positive_int_list
from dsaspec.configs.model_config import PRESETS
from dsaspec.ops import row_invariant as ri
from dsaspec.ops.moe_router import RouterGemmConfig, router_logits

METHOD = ("CUDA-graph replays with a cold L2 (time_in_graph), median per-replay device span; router_logits in each "
          "tile on the row's weight dtype (bf16: the bf16 copy of the fp32 weight), cuBLAS F.linear(x.float(), W) "
          "(copy included), cuBLAS torch.mm(x, W_bf16.T, out_dtype=fp32) and the row-invariant GEMM on x.float() on "
          "the same inputs (W holds bf16 values); floor = max((the tiles' weight + bf16 rows + fp32 logits) / "
          "measured copy bandwidth, empty kernel)")
PRESET_NAMES = ("glm5-fp8-tp8-rank", "deepseek-v32-fp8-tp8-rank")
WEIGHT_DTYPES = ("bf16", "fp32")
# rows x experts x block_k, warps: at most 64 products a thread
TILES = [RouterGemmConfig(r, e, b, w) for r, e, b, w in (
    (1, 1, 2048, 4), (2, 2, 2048, 8), (4, 2, 1024, 4), (4, 4, 512, 4), (8, 2, 1024, 8), (8, 4, 512, 8),
    (16, 8, 128, 8), (16, 16, 64, 8))]


def _name(c: RouterGemmConfig) -> str:
    return f"r{c.rows}e{c.experts}k{c.block_k}w{c.num_warps}"


def main() -> int:
    parser = Parser(prog="bench_router_gemm", description="The MoE router's GEMM: router_logits tiles vs cuBLAS.")
    parser.add_argument("out", help="folder for router_gemm.json / .md")
    parser.add_argument("--rows", type=positive_int_list, default=[1, 2, 3, 4, 16, 32, 64, 128, 256],
                        help="T values, comma-separated")
    parser.add_argument("--iters", type=positive_int, default=100, help="timed replays per point")
    parser.add_argument("--weight-dtype", type=choice_list(WEIGHT_DTYPES), default=list(WEIGHT_DTYPES),
                        help="the tiles' weight dtypes, comma-separated")
    args = parse_or_exit(parser)
    floors = measured_floors_or_none("bench_router_gemm")
    if floors is None:
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    results, ok = [], True
    for preset in PRESET_NAMES:
        config = PRESETS[preset]
        experts, k = config.n_routed_experts, config.hidden_size
        # bf16 values held in fp32, as the checkpoints' gate weights load
        w = (torch.randn(experts, k, device="cuda", generator=gen) / k ** 0.5).bfloat16().float()
        w_bf16 = w.bfloat16()
        for t, weight_dtype in ((t, d) for t in args.rows for d in args.weight_dtype):
            x = torch.randn(t, k, device="cuda", generator=gen).bfloat16()
            w_tiles = w_bf16 if weight_dtype == "bf16" else w
            nbytes = w_tiles.element_size() * experts * k + 2 * t * k + 4 * t * experts
            point = dict(preset=preset, experts=experts, k=k, t=t, weight=weight_dtype, bytes=nbytes,
                         floor_us=floors.floor_us(nbytes))
            want = F.linear(x.float(), w)
            forms = {"cublas": lambda: F.linear(x.float(), w), "row_invariant": lambda: ri.linear(x.float(), w),
                     "cublas_bf16": lambda: torch.mm(x, w_bf16.t(), out_dtype=torch.float32)}
            outs = {}
            for tile in TILES:
                out = outs[_name(tile)] = torch.empty(t, experts, device="cuda")
                forms[_name(tile)] = lambda out=out, tile=tile: router_logits(x, w_tiles, out, config=tile)
            for form, fn in forms.items():
                timing = time_in_graph(fn, iters=args.iters)
                point[form] = timing.summary()
                point[f"{form}_us"] = timing.median_us
            outs["cublas_bf16"] = torch.mm(x, w_bf16.t(), out_dtype=torch.float32)
            for form, out in outs.items():
                ok &= bool(torch.allclose(out, want, rtol=1e-4, atol=1e-4))
            tiles = [_name(tile) for tile in TILES]
            point["best_tile"] = min(tiles, key=lambda f: point[f"{f}_us"])
            point["best_over_floor"] = point[f"{point['best_tile']}_us"] / point["floor_us"]
            point["best_vs_cublas"] = point["cublas_us"] / point[f"{point['best_tile']}_us"]
            results.append(point)
    columns = ([("preset", "preset"), ("t", "T"), ("k", "K"), ("weight", "tiles' weight"), ("floor_us", "floor µs"),
                ("cublas_us", "cuBLAS µs"), ("row_invariant_us", "row-invariant GEMM µs"),
                ("cublas_bf16_us", "cuBLAS bf16 -> fp32 µs")]
               + [(f"{_name(tile)}_us", f"{_name(tile)} µs") for tile in TILES]
               + [("best_tile", "best tile"), ("best_over_floor", "best / floor"), ("best_vs_cublas", "cuBLAS / best")])
    write_results("router_gemm", dict(
        method=METHOD, params=dict(rows=args.rows, iters=args.iters, weight_dtypes=args.weight_dtype,
                                   tiles=[_name(t) for t in TILES]),
        copy_gbps=floors.copy_gbps, empty_kernel_us=floors.empty_us, results=results),
        f"router GEMM (copy {floors.copy_gbps:.0f} GB/s): router_logits tiles vs cuBLAS\n\n"
        f"{markdown_table(columns, results)}", args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
