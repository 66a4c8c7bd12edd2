"""Time the MoE router's GEMM and selection in one launch (``route_rows``) against the two launches
it replaces (``router_logits`` then ``route_topk``) on one GPU, at the per-rank presets' router
(hidden x 256 experts, their routing, one shared slot) and T tokens, in the default mode's decode
tile for T and in the row-invariant mode's tile; with the default mode's path from
``BF16_GEMM_MIN_TOKENS`` rows (cuBLAS's bf16 GEMM, then ``route_topk``) beside them. Per point: the
median per-replay span of a cold-L2 CUDA-graph replay (time_in_graph), and whether the one launch
gave the two launches' ids and weights bit for bit. Writes ``route_rows.json`` and ``.md`` to the
folder given.

    python3 scripts/bench_route_rows.py OUT [--rows 1,2,4,8,16]
"""

from __future__ import annotations

import sys

import torch

from dsaspec.bench.results import markdown_table, write_results
from dsaspec.bench.timing import time_in_graph
from dsaspec.cli_parsing import Parser, parse_or_exit, positive_int, positive_int_list
from dsaspec.configs.model_config import PRESETS
from dsaspec.ops.moe_router import DECODE_MAX_TOKENS, RouterGemmConfig, decode_tile, route_rows, route_topk, router_logits

METHOD = ("CUDA-graph replays with a cold L2 (time_in_graph), median per-replay device span (first to last kernel); "
          "route_rows (one launch) against router_logits + route_topk (two) in the same tile, and cuBLAS "
          "torch.mm(x, W_bf16.T, out_dtype=fp32) + route_topk; W holds bf16 values, one shared slot")
PRESET_NAMES = ("glm5-fp8-tp8-rank", "deepseek-v32-fp8-tp8-rank")


def main() -> int:
    parser = Parser(prog="bench_route_rows", description="The MoE router in one launch against two.")
    parser.add_argument("out", help="folder for route_rows.json / .md")
    parser.add_argument("--rows", type=positive_int_list, default=[1, 2, 4, 8, 16],
                        help=f"T values, comma-separated, at most {DECODE_MAX_TOKENS}")
    parser.add_argument("--iters", type=positive_int, default=100, help="timed replays per point")
    args = parse_or_exit(parser)
    if max(args.rows) > DECODE_MAX_TOKENS:
        print(f"bench_route_rows: error: --rows: expected at most {DECODE_MAX_TOKENS}, got {max(args.rows)}",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_route_rows: error: needs a CUDA device", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    results, ok = [], True
    for preset in PRESET_NAMES:
        config = PRESETS[preset]
        experts, k = config.n_routed_experts, config.hidden_size
        routing = dict(top_k=config.num_experts_per_tok, n_group=config.n_group, topk_group=config.topk_group,
                       norm_topk_prob=config.norm_topk_prob, scaling=config.routed_scaling_factor, n_shared=1)
        w = (torch.randn(experts, k, device="cuda", generator=gen) / k ** 0.5).bfloat16().float()
        w_bf16 = w.bfloat16()
        bias = torch.randn(experts, device="cuda", generator=gen) * 0.1
        for t in args.rows:
            x = torch.randn(t, k, device="cuda", generator=gen).bfloat16()
            tiles = [("default", decode_tile(t)), ("row-invariant", RouterGemmConfig())]
            tiles += [("one warp", RouterGemmConfig(1, 1, block_k, 1)) for block_k in (2048, 1024)]
            for mode, tile in tiles:
                forms = {"two": lambda tile=tile: route_topk(router_logits(x, w, config=tile), bias, **routing),
                         "one": lambda tile=tile: route_rows(x, w, bias, config=tile, **routing),
                         "cublas_bf16": lambda: route_topk(torch.mm(x, w_bf16.t(), out_dtype=torch.float32), bias,
                                                           **routing)}
                point = dict(preset=preset, t=t, mode=mode, tile=str(tile))
                for form, fn in forms.items():
                    timing = time_in_graph(fn, iters=args.iters)
                    point[form] = timing.summary()
                    point[f"{form}_us"] = timing.median_us
                (ids1, w1), (ids2, w2) = forms["one"](), forms["two"]()
                point["identical"] = bool(torch.equal(ids1, ids2) and torch.equal(w1, w2))
                point["one_over_two"] = point["one_us"] / point["two_us"]
                ok &= point["identical"]
                results.append(point)
    columns = [("preset", "preset"), ("mode", "mode"), ("t", "T"), ("tile", "tile"), ("two_us", "two launches µs"),
               ("one_us", "one launch µs"), ("one_over_two", "one / two"), ("cublas_bf16_us", "cuBLAS bf16 + select µs"),
               ("identical", "same bits")]
    write_results("route_rows", dict(method=METHOD, params=dict(rows=args.rows, iters=args.iters), results=results),
                  f"MoE router: GEMM + selection in one launch against two\n\n{markdown_table(columns, results)}",
                  args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
