"""Time ``fp8_linear`` with the activation quantization fused into the GEMM (one launch) against
``act_quant`` then ``fp8_gemm`` (two launches) on one GPU, at the FP8 linear shapes of a per-rank
preset and M rows: per shape and M, the median per-replay span of a cold-L2 CUDA-graph replay
(first to last device activity, so the gap between the two launches counts) and the graph-difference
time, both forms' bits checked equal. Writes ``fp8_linear_<preset>.json`` and ``.md`` to the
folder given and prints the table; where fused stops winning (in M and in K) sets ``FUSED_QUANT_MAX_M``
and ``FUSED_QUANT_MAX_K``.

    python3 scripts/bench_fp8_linear.py OUT [--preset deepseek-v32-fp8-tp8-rank] [--rows 1,4,16,64,256]
"""

from __future__ import annotations

import sys

import torch

from dsaspec.bench.results import markdown_table, write_results
from dsaspec.bench.timing import time_in_graph, warm_up_gpu
from dsaspec.cli_parsing import Parser, parse_or_exit, positive_int, positive_int_list
from dsaspec.configs.model_config import PRESETS
from dsaspec.ops import fp8_gemm as op

METHOD = ("CUDA-graph replays with a cold L2 (time_in_graph), median per-replay device span; both forms "
          "of fp8_linear on the same inputs, their bits compared")


def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """``(N, K)`` of the attention and shared-expert projections of one layer of ``config``."""
    heads = config.num_attention_heads
    shapes = {
        "q_a_proj": (config.q_lora_rank, config.hidden_size),
        "kv_a_proj": (config.kv_lora_rank + config.qk_rope_head_dim, config.hidden_size),
        "q_b_proj": (heads * (config.qk_nope_head_dim + config.qk_rope_head_dim), config.q_lora_rank),
        "kv_b_proj": (heads * (config.qk_nope_head_dim + config.v_head_dim), config.kv_lora_rank),
        "o_proj": (config.hidden_size, heads * config.v_head_dim),
    }
    shared = config.moe_intermediate_size * config.n_shared_experts
    if shared:
        shapes |= {"shared_gate_up": (2 * shared, config.hidden_size), "shared_down": (config.hidden_size, shared)}
    return shapes


def main() -> int:
    parser = Parser(prog="bench_fp8_linear", description="fp8_linear: fused activation quantization vs two launches.")
    parser.add_argument("out", help="folder for fp8_linear_<preset>.json / .md")
    fp8_presets = sorted(name for name, config in PRESETS.items() if config.quantization is not None)
    parser.add_argument("--preset", default="deepseek-v32-fp8-tp8-rank", choices=fp8_presets)
    parser.add_argument("--rows", type=positive_int_list, default=[1, 4, 16, 64, 256], help="M values, comma-separated")
    parser.add_argument("--iters", type=positive_int, default=100, help="timed replays per point")
    args = parse_or_exit(parser)
    if not torch.cuda.is_available():
        print("bench_fp8_linear: error: needs a CUDA device", file=sys.stderr)
        return 2
    config = PRESETS[args.preset]
    scale_fmt = config.quantization.scale_fmt
    warm_up_gpu()
    results = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in linear_shapes(config).items():
        w, w_s = op.quantize_weight(torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            outs = {fused: torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for fused in (True, False)}
            point = dict(layer=name, n=n, k=k, m=m)
            for fused, out in outs.items():
                timing = time_in_graph(lambda: op.fp8_linear(x, w, w_s, scale_fmt, out=out, fuse_quant=fused),
                                       iters=args.iters)
                point["fused" if fused else "two_launch"] = timing.summary()
            point["bitwise_equal"] = torch.equal(outs[True].view(torch.int16), outs[False].view(torch.int16))
            point["speedup"] = point["two_launch"]["median_us"] / point["fused"]["median_us"]
            results.append(point)
    table = markdown_table([("layer", "layer"), ("n", "N"), ("k", "K"), ("m", "M"), ("two_launch_us", "two launches µs"),
                            ("fused_us", "fused µs"), ("speedup", "speedup"), ("bitwise_equal", "bitwise")],
                           [dict(p, two_launch_us=p["two_launch"]["median_us"], fused_us=p["fused"]["median_us"])
                            for p in results])
    write_results(f"fp8_linear_{args.preset}", dict(
        method=METHOD, params=dict(preset=args.preset, scale_fmt=scale_fmt, rows=args.rows, iters=args.iters),
        fused_quant_max_m=op.FUSED_QUANT_MAX_M, fused_quant_max_k=op.FUSED_QUANT_MAX_K, results=results),
        f"fp8_linear, {args.preset} (scale_fmt {scale_fmt}): fused quantization vs two launches\n\n{table}",
        args.out)
    return 0 if all(p["bitwise_equal"] for p in results) else 1


if __name__ == "__main__":
    sys.exit(main())
